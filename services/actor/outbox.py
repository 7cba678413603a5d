"""The actor's outbox: generated batches it could not publish (Redis down), kept in LMDB until Redis
returns (docs/architecture.md, "Durability").

Intended use (actor):

    try:
        await bus.publish(stream, data, **headers)
    except BusUnavailable:
        outbox.put(batch_id, stream, data, headers)   # durable when it returns
    await bus.ack(prompt_msg, "actor")                # only now: the work is either sent or kept

and a background task runs `await outbox.flush(lambda s, d, h: bus.publish(s, d, **h))` every
second. Generated work is never lost (the prompt is acked only once the batch is on Redis or on
disk here) and never regenerated needlessly (a Redis outage does not send the prompt back).

Delivery is at-least-once: an entry is deleted only after its publish returned, so a crash between
the two publishes it again after restart. Downstream absorbs that duplicate by batch id (stage
results are written put-if-absent, the journal refuses a second `generated`). Entries go out in
`put` order; a publish that fails with `BusUnavailable` ends the flush with that entry and all
later ones kept.

Layout (named sub-databases of one LMDB environment; one write transaction per mutation, fsynced
before it returns, so kill -9 or power loss keeps every `put` that returned):

    entries  seq (8-byte big-endian: byte order == numeric order) -> record
    keys     caller key (batch id)                                -> seq    put is idempotent per key
    meta     b"next_seq" (8-byte big-endian), b"schema"

`next_seq` is persisted rather than derived from the last entry, so sequence numbers keep growing
across an emptied and reopened outbox. A record is a 4-byte big-endian length, a JSON header (key,
stream, headers, put time) and the payload bytes; nothing is pickled.

Like the journal: the map grows by doubling up to `max_map_size` (it is address space, not disk,
with writemap off), a full map or a full filesystem raises `OutboxFull` with nothing of that write
committed, and only one `Outbox` per environment per process (LMDB's locks are per process).
Methods are synchronous and thread-safe except `flush`, which does its LMDB work in a thread so the
event loop keeps running during fsyncs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from services.core.journal.lmdb_store import LmdbStore, StoreFull
from services.core.transport.bus import BusUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
Publish = Callable[[str, bytes, dict[str, str]], Awaitable[str]]

SCHEMA_VERSION = 1
DEFAULT_MAP_SIZE = 64 << 20  # 64 MiB
# The outbox holds at most the batches in flight when Redis went away (no prompts arrive without
# Redis), so this ceiling is generous; with writemap off it costs address space only.
DEFAULT_MAX_MAP_SIZE = 16 << 30
_MAX_KEY_BYTES = 511  # LMDB's compiled-in key size limit
_LEN = struct.Struct(">I")
_DB_NAMES = (b"entries", b"keys", b"meta")


class OutboxError(RuntimeError):
    """An outbox operation that cannot succeed (closed, bad argument, unreadable record)."""


class OutboxFull(OutboxError, StoreFull):
    """The outbox cannot grow: its map reached `max_map_size` or its filesystem is full.

    Nothing of the failed `put` was written; earlier entries are intact. The actor must not ack the
    prompt then: its worker holds the message and retries it (a `StoreFull`) until there is room."""


@dataclass(frozen=True)
class OutboxEntry:
    seq: int
    key: str
    stream: str
    data: bytes
    headers: dict[str, str]
    put_at: float


def _seq_key(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _encode(key: str, stream: str, data: bytes, headers: Mapping[str, str]) -> bytes:
    head = json.dumps(
        {"key": key, "stream": stream, "headers": dict(headers), "put_at": time.time()}, separators=(",", ":")
    ).encode()
    return _LEN.pack(len(head)) + head + data


def _decode(seq: int, raw: bytes) -> OutboxEntry:
    try:
        (n,) = _LEN.unpack_from(raw)
        head = json.loads(raw[_LEN.size : _LEN.size + n])
        return OutboxEntry(
            seq=seq,
            key=str(head["key"]),
            stream=str(head["stream"]),
            data=bytes(raw[_LEN.size + n :]),
            headers={str(k): str(v) for k, v in head["headers"].items()},
            put_at=float(head["put_at"]),
        )
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise OutboxError(f"outbox entry {seq} is unreadable: {type(err).__name__}: {err}") from err


class Outbox(LmdbStore):
    """Create with `Outbox.open(path)`."""

    kind = "outbox"
    error = OutboxError
    full_error = OutboxFull
    db_names = _DB_NAMES
    schema_version = SCHEMA_VERSION
    full_advice = ("Nothing of this write was stored and pending entries are intact; free disk space"
                   " (or raise max_map_size).")

    def __init__(self, path: Path, *, map_size: int, max_map_size: int, sync: bool) -> None:
        super().__init__(path, map_size=map_size, max_map_size=max_map_size, sync=sync, metasync=sync,
                         readonly=False)
        # One flush at a time: two concurrent flushes would publish the head entry twice.
        self._flushing = False

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int = DEFAULT_MAX_MAP_SIZE,
        sync: bool = True,
    ) -> Outbox:
        """Open (creating) the outbox in directory `path`.

        `sync=False` skips the fsync per commit: a process crash still loses nothing (the page
        cache survives kill -9), a power loss may lose the last puts. Reader slots left by killed
        processes are cleared on open."""
        return cls._open_store(path, map_size, max_map_size, False, lambda p, size, max_size: cls(
            p, map_size=size, max_map_size=max_size, sync=sync))

    # -- operations --------------------------------------------------------------------------

    def put(self, key: str, stream: str, data: bytes, headers: Mapping[str, str]) -> bool:
        """Keep one message for `stream`; durable when this returns.

        `key` identifies the message (the batch id): putting a key that is still pending again is a
        no-op returning False, so a retried put never queues a second copy."""
        if not isinstance(key, str) or not key:
            raise OutboxError(f"outbox key must be a non-empty string, got {key!r}")
        kb = key.encode()
        if len(kb) > _MAX_KEY_BYTES:
            raise OutboxError(f"outbox key {key[:40]!r}... is {len(kb)} bytes; at most {_MAX_KEY_BYTES}")
        if not isinstance(stream, str) or not stream:
            raise OutboxError(f"stream must be a non-empty string, got {stream!r}")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"outbox data must be bytes, got {type(data).__name__}")
        for name, value in headers.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError(f"headers must map str to str, got {name!r}: {type(value).__name__}")
        record = _encode(key, stream, bytes(data), headers)

        def fn(txn: Any) -> bool:
            if txn.get(kb, db=self._dbs[b"keys"]) is not None:
                return False
            raw = txn.get(b"next_seq", db=self._dbs[b"meta"])
            seq = 0 if raw is None else int.from_bytes(raw, "big")
            txn.put(_seq_key(seq), record, db=self._dbs[b"entries"])
            txn.put(kb, _seq_key(seq), db=self._dbs[b"keys"])
            txn.put(b"next_seq", _seq_key(seq + 1), db=self._dbs[b"meta"])
            return True

        stored = self._write(fn)
        if stored:
            log.info("outbox.put", extra={"key": key, "stream": stream, "bytes": len(data)})
        return stored

    def pending(self) -> int:
        """Entries waiting to be published."""
        return int(self._read(lambda txn: txn.stat(self._dbs[b"entries"])["entries"]))

    def peek(self, limit: int | None = None, after: int = -1) -> list[OutboxEntry]:
        """Up to `limit` pending entries with seq > `after`, oldest first (for flush, status pages
        and operators)."""

        def fn(txn: Any) -> list[OutboxEntry]:
            out: list[OutboxEntry] = []
            cur = txn.cursor(db=self._dbs[b"entries"])
            found = cur.set_range(_seq_key(after + 1))
            while found and (limit is None or len(out) < limit):
                out.append(_decode(int.from_bytes(cur.key(), "big"), cur.value()))
                found = cur.next()
            return out

        return self._read(fn)

    def discard(self, seq: int) -> bool:
        """Delete entry `seq` (after it was published, or by an operator giving up on it).
        False when it was not there."""

        def fn(txn: Any) -> bool:
            raw = txn.get(_seq_key(seq), db=self._dbs[b"entries"])
            if raw is None:
                return False
            entry = _decode(seq, raw)
            txn.delete(_seq_key(seq), db=self._dbs[b"entries"])
            # Only if the key still maps to this entry (it always does; cheap to be exact).
            kb = entry.key.encode()
            if txn.get(kb, db=self._dbs[b"keys"]) == _seq_key(seq):
                txn.delete(kb, db=self._dbs[b"keys"])
            return True

        return self._write(fn)

    async def flush(self, publish: Publish) -> int:
        """Publish pending entries in order, deleting each once its publish returned; returns how
        many were sent.

        Stops at the first `BusUnavailable`, keeping that entry and the rest for the next flush.
        Any other error from `publish` propagates with the entry kept. A flush already running
        (from another task) makes this one return 0 at once. Entries put while flushing are sent
        by the same flush."""
        if self._flushing:
            return 0
        self._flushing = True
        sent = 0
        try:
            after = -1
            while True:
                batch = await asyncio.to_thread(self.peek, 1, after)
                if not batch:
                    break
                entry = batch[0]
                try:
                    msg_id = await publish(entry.stream, entry.data, dict(entry.headers))
                except BusUnavailable as err:
                    log.info("outbox.flush_paused", extra={"sent": sent, "key": entry.key, "error": str(err)})
                    break
                # A crash right here publishes this entry again after restart: at-least-once.
                await asyncio.to_thread(self.discard, entry.seq)
                sent += 1
                after = entry.seq
                log.info("outbox.flushed", extra={"key": entry.key, "stream": entry.stream, "id": msg_id})
        finally:
            self._flushing = False
        return sent

