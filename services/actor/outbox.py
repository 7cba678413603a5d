"""The actor's outbox: generated batches it could not publish (Redis down), kept in LMDB until Redis
returns (DESIGN.md, "Durability").

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
import errno
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from services.core.bus import BusUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
Publish = Callable[[str, bytes, dict[str, str]], Awaitable[str]]

SCHEMA_VERSION = 1
DEFAULT_MAP_SIZE = 64 << 20  # 64 MiB
# The outbox holds at most the batches in flight when Redis went away (no prompts arrive without
# Redis), so this ceiling is generous; with writemap off it costs address space only.
DEFAULT_MAX_MAP_SIZE = 16 << 30
# LMDB reports a short write (the disk filled mid-write) as EIO; below this much free space we
# read such an EIO as "disk full" rather than a failing device.
DISK_FULL_SLACK_BYTES = 1 << 20
_MAX_KEY_BYTES = 511  # LMDB's compiled-in key size limit
_LEN = struct.Struct(">I")
_DB_NAMES = (b"entries", b"keys", b"meta")

_OPEN_PATHS: set[str] = set()
_OPEN_PATHS_LOCK = threading.Lock()


class OutboxError(RuntimeError):
    """An outbox operation that cannot succeed (closed, bad argument, unreadable record)."""


class OutboxFull(OutboxError):
    """The outbox cannot grow: its map reached `max_map_size` or its filesystem is full.

    Nothing of the failed `put` was written; earlier entries are intact. The actor must not ack the
    prompt then: it is redelivered and generated again once there is room."""


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


class Outbox:
    """Create with `Outbox.open(path)`."""

    def __init__(self, path: Path, *, map_size: int, max_map_size: int, sync: bool) -> None:
        self._path = path
        self._map_size = map_size
        self._max_map_size = max_map_size
        self._sync = sync
        self._lock = threading.RLock()
        self._env: Any = None
        self._dbs: dict[bytes, Any] = {}
        self._closed = False
        self._path_key = ""
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
        if map_size <= 0 or max_map_size < map_size:
            raise ValueError(f"need 0 < map_size <= max_map_size, got {map_size} and {max_map_size}")
        p = Path(path).absolute()
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutboxFull(f"outbox {p} cannot be created: filesystem full ({err})") from err
            raise
        data = p / "data.mdb"
        if data.exists():
            # Reopen at least at the size the file already has: no replay of earlier doublings.
            map_size = max(map_size, data.stat().st_size)
            max_map_size = max(max_map_size, map_size)
        key = str(p.resolve())
        with _OPEN_PATHS_LOCK:
            if key in _OPEN_PATHS:
                raise OutboxError(f"outbox {p} is already open in this process (LMDB allows one handle per process)")
            _OPEN_PATHS.add(key)
        box = cls(p, map_size=map_size, max_map_size=max_map_size, sync=sync)
        box._path_key = key
        try:
            box._open_env()
            box._check_schema()
            box._env.reader_check()
        except BaseException:
            box.close()
            raise
        return box

    def _open_env(self) -> None:
        try:
            env = lmdb.open(
                str(self._path),
                map_size=self._map_size,
                max_dbs=len(_DB_NAMES) + 1,
                subdir=True,
                sync=self._sync,
                metasync=self._sync,
                # Off: a full disk is then an error code on pwrite, not SIGBUS on a mapped page.
                writemap=False,
                readahead=False,
                lock=True,
            )
        except lmdb.Error as err:
            if self._is_disk_full(err):
                raise self._full(f"cannot open: {err}") from err
            raise OutboxError(f"cannot open outbox {self._path}: {err}") from err
        self._dbs = {name: env.open_db(name) for name in _DB_NAMES}
        self._env = env
        self._map_size = env.info()["map_size"]

    def _check_schema(self) -> None:
        def fn(txn: Any) -> None:
            raw = txn.get(b"schema", db=self._dbs[b"meta"])
            if raw is None:
                txn.put(b"schema", str(SCHEMA_VERSION).encode(), db=self._dbs[b"meta"])
            elif int(raw) != SCHEMA_VERSION:
                raise OutboxError(f"outbox {self._path} has schema {int(raw)}, this code reads {SCHEMA_VERSION}")

        self._write(fn)

    def close(self) -> None:
        """Close the environment. Stop the flushing task first: a flush after close raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._env is not None:
                self._env.close()
                self._env = None
            with _OPEN_PATHS_LOCK:
                _OPEN_PATHS.discard(self._path_key)

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def map_size(self) -> int:
        return self._map_size

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

    # -- transaction plumbing ----------------------------------------------------------------

    def _require_env(self) -> Any:
        if self._closed:
            raise OutboxError(f"outbox {self._path} is closed")
        if self._env is None:
            self._open_env()  # a disk error closed it (see _heal); reopen now
        return self._env

    def _write(self, fn: Callable[[Any], T]) -> T:
        """Run `fn` in one write transaction, committed (and fsynced) on return.

        A full map is grown and `fn` re-run from scratch, so `fn` must derive everything from
        the transaction."""
        with self._lock:
            while True:
                env = self._require_env()
                try:
                    with env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self._grow()
                except lmdb.MapResizedError:
                    env.set_mapsize(0)  # another process grew it; adopt its size and retry
                    self._map_size = env.info()["map_size"]
                except (lmdb.Error, OSError) as err:
                    if self._is_disk_full(err):
                        self._heal()
                        raise self._full(f"the disk filled up during a commit (LMDB: {err})") from err
                    raise OutboxError(f"outbox {self._path}: {err}") from err

    def _read(self, fn: Callable[[Any], T]) -> T:
        with self._lock:
            for _ in range(2):
                env = self._require_env()
                try:
                    with env.begin(write=False) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    env.set_mapsize(0)
                    self._map_size = env.info()["map_size"]
            raise OutboxError(f"outbox {self._path}: map keeps being resized by another process")

    def _grow(self) -> None:
        if self._map_size >= self._max_map_size:
            raise self._full(f"map size {self._map_size} bytes reached max_map_size {self._max_map_size}")
        # Safe: we hold the lock and the failed transaction was aborted, so none of ours is open.
        self._env.set_mapsize(min(self._map_size * 2, self._max_map_size))
        self._map_size = self._env.info()["map_size"]
        log.info("outbox.grown", extra={"map_size": self._map_size})

    def _free_bytes(self) -> int:
        st = os.statvfs(self._path)
        return st.f_bavail * st.f_frsize

    def _is_disk_full(self, err: BaseException) -> bool:
        if isinstance(err, OSError):
            return err.errno in (errno.ENOSPC, errno.EDQUOT)
        msg = str(err)
        if os.strerror(errno.ENOSPC) in msg or os.strerror(errno.EDQUOT) in msg:
            return True
        if isinstance(err, lmdb.DiskError) or os.strerror(errno.EIO) in msg:
            try:
                return self._free_bytes() < DISK_FULL_SLACK_BYTES
            except OSError:
                return False
        return False

    def _full(self, detail: str) -> OutboxFull:
        try:
            free = f"{self._free_bytes()} bytes free"
        except OSError as err:
            free = f"free space unknown ({err})"
        return OutboxFull(
            f"outbox {self._path} is full: {detail}; {free} on its filesystem. Nothing of this write"
            f" was stored and pending entries are intact; free disk space (or raise max_map_size)."
        )

    def _heal(self) -> None:
        """A failed commit that hit the meta page leaves the environment unusable; reopening rereads
        the newest meta page that fully reached disk."""
        try:
            with self._env.begin(write=False):
                pass
        except lmdb.Error:
            try:
                self._env.close()
            finally:
                self._env = None
