"""The asynchronous Redis Streams bus between the services (docs/architecture.md, "Contracts").

Streams per run: `rlfleet:<run>:prompts` (group "actor"), `rlfleet:<run>:rollouts` (one group per
scoring stage: fan-out), `rlfleet:<run>:scores` (group "controller") and `rlfleet:<run>:dead`
(dead letters, read by the controller and by people).

Delivery is at-least-once: a consumer acks only after its result is durably written, results are
written put-if-absent so a redelivery never counts twice, entries a dead consumer left pending are
reclaimed with XAUTOCLAIM after `reclaim_idle_ms`, and an entry that was delivered
`max_deliveries` times without an ack moves to the dead-letter stream instead of being delivered
again. Streams are only ever trimmed below the oldest entry some group still needs.

Every Redis failure that means "the bus is not reachable right now" surfaces as `BusUnavailable`
(a `ConnectionError`) naming host:port, so callers such as the actor's outbox can hold work and
retry. Payloads are opaque bytes and never logged.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.typing import EncodableT, FieldT

from services.core.config import FlowSection

log = logging.getLogger(__name__)

T = TypeVar("T")

DATA_FIELD: Final = "data"
# Header fields copied into a dead-letter record are prefixed so they cannot shadow its own fields.
DEAD_HEADER_PREFIX: Final = "h."
# Headers are routing metadata (kind, task_count, batch_id, schema), not a second payload channel.
MAX_HEADERS: Final = 16
MAX_HEADER_VALUE_CHARS: Final = 512
MAX_REASON_CHARS: Final = 2000
# When Redis cannot report a group's lag, we count entries after its last-delivered id, up to this
# many: enough to saturate any sensible fill ratio without scanning a huge stream.
LAG_SCAN_CAP: Final = 100_000

_RUN_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Stage and group names end up inside result keys, so no ':'; consumer names may carry host:pid.
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_CONSUMER_RE: Final = re.compile(r"^[A-Za-z0-9_.:@-]{1,200}$")
_HEADER_RE: Final = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_MAX_SEQ: Final = 2**64 - 1


# -- errors ------------------------------------------------------------------------------------
class BusError(Exception):
    """A bus operation that cannot succeed as asked (not a connectivity problem)."""


class BusUnavailable(ConnectionError):
    """Redis is unreachable (down, restarting, refusing, out of memory); retry later.

    The message names host:port and never the password."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class MessageTooLarge(BusError, ValueError):
    """A payload over `flow.max_message_bytes`; rejected before anything is sent."""


# -- names -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamKeys:
    """Redis key names for one run; the only place that spells them."""

    run: str

    def __post_init__(self) -> None:
        if not _RUN_RE.match(self.run):
            raise ValueError(f"run name must match {_RUN_RE.pattern}, got {self.run!r}")

    @property
    def prefix(self) -> str:
        return f"rlfleet:{self.run}"

    @property
    def prompts(self) -> str:
        return f"{self.prefix}:prompts"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def scores(self) -> str:
        return f"{self.prefix}:scores"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def streams(self) -> dict[str, str]:
        """Short name -> stream key, for metrics labels."""
        return {"prompts": self.prompts, "rollouts": self.rollouts, "scores": self.scores, "dead": self.dead}

    def result(self, stage: str, batch_id: str) -> str:
        _check_name("stage", stage)
        if not batch_id or len(batch_id) > 256 or any(c.isspace() for c in batch_id):
            raise ValueError(f"batch_id must be 1-256 characters without whitespace, got {batch_id!r}")
        return f"{self.prefix}:result:{stage}:{batch_id}"


@dataclass(frozen=True)
class Message:
    """One delivered stream entry. `deliveries` counts this delivery (1 on first read)."""

    stream: str
    id: str
    data: bytes
    headers: dict[str, str]
    deliveries: int


def bus_options(flow: FlowSection) -> dict[str, int]:
    """The `Bus` keyword arguments that come from the run config's flow section."""
    return {
        "max_message_bytes": flow.max_message_bytes,
        "max_deliveries": flow.max_deliveries,
        "reclaim_idle_ms": flow.reclaim_idle_ms,
    }


_FLOW_DEFAULTS: Final = FlowSection()


# -- the bus -----------------------------------------------------------------------------------
class Bus:
    """Publish, consume, ack, reclaim and dead-letter on one run's streams.

    One instance per process; it is safe to use from many asyncio tasks at once (each command
    takes its own pooled connection). The client must not decode responses (payloads are bytes).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: StreamKeys,
        *,
        max_message_bytes: int,
        max_deliveries: int,
        reclaim_idle_ms: int,
        result_ttl_s: float | None = None,
        op_timeout_s: float = 10.0,
        dead_data_max_bytes: int = 1024 * 1024,
    ) -> None:
        for name, value in (
            ("max_message_bytes", max_message_bytes),
            ("max_deliveries", max_deliveries),
            ("reclaim_idle_ms", reclaim_idle_ms),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if result_ttl_s is not None and result_ttl_s <= 0:
            raise ValueError(f"result_ttl_s must be > 0 or None, got {result_ttl_s}")
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self._client = client
        self.keys = keys
        self.max_message_bytes = max_message_bytes
        self.max_deliveries = max_deliveries
        self.reclaim_idle_ms = reclaim_idle_ms
        self._result_ttl_ms = None if result_ttl_s is None else max(1, int(result_ttl_s * 1000))
        self._op_timeout_s = op_timeout_s
        self._dead_data_max_bytes = max(0, dead_data_max_bytes)
        kw = client.connection_pool.connection_kwargs
        if kw.get("protocol") not in (None, 2, "2") or kw.get("decode_responses"):
            # Reply shapes below are RESP2's, and payloads are bytes.
            raise ValueError("Bus needs a RESP2 client with decode_responses=False")
        self.endpoint = (
            f"unix:{kw['path']}"
            if kw.get("path")
            else f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
        )
        self._password: str | None = kw.get("password")
        # Groups this process created, per stream: recreated on NOGROUP, and trim refuses to run
        # while one of them is missing (it would otherwise trim entries that group still needs).
        self._groups: dict[str, set[str]] = {}
        # XAUTOCLAIM cursor per (stream, group), so a long pending list is scanned across reads
        # instead of re-scanning its non-idle head every time.
        self._claim_cursor: dict[tuple[str, str], str] = {}
        # Earliest monotonic time of the next reclaim scan per (stream, group): after a complete
        # scan nothing new can become idle enough for a while, so reads skip the round trip.
        self._next_reclaim: dict[tuple[str, str], float] = {}

    # -- lifecycle --------------------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        url: str,
        run: str,
        *,
        password: str | None = None,
        max_message_bytes: int = _FLOW_DEFAULTS.max_message_bytes,
        max_deliveries: int = _FLOW_DEFAULTS.max_deliveries,
        reclaim_idle_ms: int = _FLOW_DEFAULTS.reclaim_idle_ms,
        result_ttl_s: float | None = None,
        op_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
    ) -> Bus:
        """Connect and PING; raises `BusUnavailable` naming host:port when Redis is unreachable."""
        keys = StreamKeys(run)
        endpoint = _endpoint_from_url(url)
        extra: dict[str, Any] = {}
        if password is not None:
            extra["password"] = password
        try:
            client = aioredis.Redis.from_url(
                url,
                # No socket read timeout: blocking XREADGROUP may legitimately wait; every command
                # is bounded by `op_timeout_s` (+ its block time) with asyncio.wait_for instead.
                socket_timeout=None,
                socket_connect_timeout=connect_timeout_s,
                # A couple of quick retries ride over a dropped idle connection; anything longer is
                # the caller's decision (the outbox holds work), so fail fast with BusUnavailable.
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
                decode_responses=False,
                **extra,
            )
        except ValueError as err:
            # redis-py's URL errors do not echo the URL, so no password can leak here.
            raise ValueError(f"invalid Redis URL for {endpoint}: {err}") from None
        bus = cls(
            client,
            keys,
            max_message_bytes=max_message_bytes,
            max_deliveries=max_deliveries,
            reclaim_idle_ms=reclaim_idle_ms,
            result_ttl_s=result_ttl_s,
            op_timeout_s=op_timeout_s,
        )
        try:
            await bus.ping()
        except BaseException:
            await client.aclose()
            raise
        _log(logging.INFO, "bus.connected", endpoint=bus.endpoint, run=run)
        return bus

    async def ping(self) -> None:
        """Raise `BusUnavailable` unless Redis answers (for readiness checks)."""
        await self._run("ping", self._client.ping())

    async def close(self) -> None:
        await self._client.aclose()

    # -- groups -----------------------------------------------------------------------------------
    async def ensure_groups(self, stream: str, groups: Sequence[str]) -> None:
        """Create the consumer groups (and the stream) if missing; existing groups are left alone.

        New groups start at id 0, not `$`: a stage that joins late, or a group recreated after Redis
        lost its data, must still see entries published before it existed (at-least-once;
        duplicates are absorbed by put-if-absent results)."""
        for group in groups:
            _check_name("group", group)
            try:
                await self._run(
                    "ensure_groups", self._client.xgroup_create(stream, group, id="0", mkstream=True)
                )
                _log(logging.INFO, "bus.group_created", stream=stream, group=group)
            except rexc.ResponseError as err:
                if not str(err).startswith("BUSYGROUP"):
                    raise
            self._groups.setdefault(stream, set()).add(group)

    # -- produce ----------------------------------------------------------------------------------
    async def publish(self, stream: str, data: bytes, **headers: str) -> str:
        """Append one message; returns its stream id. Oversized data is rejected before sending."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"message data must be bytes, got {type(data).__name__}")
        payload = bytes(data)
        if len(payload) > self.max_message_bytes:
            raise MessageTooLarge(
                f"message for {stream} is {len(payload)} bytes, over flow.max_message_bytes="
                f"{self.max_message_bytes}; send smaller batches (batch.prompts_per_message)"
                " or raise the limit"
            )
        fields = _encode_headers(headers)
        fields[DATA_FIELD.encode()] = payload
        # Never MAXLEN here: trimming on publish could drop entries a lagging group still needs.
        raw_id = await self._run("publish", self._client.xadd(stream, fields))
        msg_id = _s(raw_id)
        _log(
            logging.DEBUG,
            "bus.published",
            stream=stream,
            id=msg_id,
            bytes=len(payload),
            kind=headers.get("kind"),
            batch_id=headers.get("batch_id"),
        )
        return msg_id

    # -- consume ----------------------------------------------------------------------------------
    async def read(self, stream: str, group: str, consumer: str, count: int, block_ms: int) -> list[Message]:
        """Up to `count` messages for `consumer` in `group`.

        Idle pending entries of other (dead) consumers are reclaimed first; then new entries are
        read, blocking up to `block_ms` (0: do not block) only when nothing was reclaimed. Entries
        already delivered `max_deliveries` times, or malformed, go to the dead-letter stream instead
        of being returned. A group lost with Redis's data (NOGROUP) is recreated and the read
        retried once."""
        _check_name("group", group)
        if not _CONSUMER_RE.match(consumer):
            raise ValueError(f"consumer name must match {_CONSUMER_RE.pattern}, got {consumer!r}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        for attempt in range(2):
            try:
                return await self._read_once(stream, group, consumer, count, block_ms)
            except rexc.ResponseError as err:
                if attempt or not str(err).startswith("NOGROUP"):
                    raise
                _log(logging.WARNING, "bus.group_missing", stream=stream, group=group, action="recreate")
                self._claim_cursor.pop((stream, group), None)
                self._next_reclaim.pop((stream, group), None)
                await self.ensure_groups(stream, [group])
        raise AssertionError("unreachable")  # pragma: no cover

    async def _read_once(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Message]:
        out = await self._reclaim(stream, group, consumer, count)
        want = count - len(out)
        if want <= 0:
            return out
        # Block only when there is nothing to hand back yet; redis-py's block=0 would mean "forever".
        block = block_ms if block_ms > 0 and not out else None
        resp = await self._run(
            "read",
            self._client.xreadgroup(group, consumer, {stream: ">"}, count=want, block=block),
            extra_s=(block or 0) / 1000,
        )
        for raw_id, fields in _stream_entries(resp):
            msg = await self._accept(stream, group, _s(raw_id), fields, deliveries=1)
            if msg is not None:
                out.append(msg)
        return out

    async def _reclaim(self, stream: str, group: str, consumer: str, count: int) -> list[Message]:
        key = (stream, group)
        if time.monotonic() < self._next_reclaim.get(key, 0.0):
            return []
        start = self._claim_cursor.get(key, "0-0")
        resp = await self._run(
            "reclaim",
            self._client.xautoclaim(
                stream, group, consumer, self.reclaim_idle_ms, start_id=start, count=count
            ),
        )
        cursor, entries = _s(resp[0]), list(resp[1] or [])
        deleted = list(resp[2]) if len(resp) > 2 and resp[2] else []
        self._claim_cursor[key] = cursor
        if cursor == "0-0" and len(entries) < count:
            # The scan went round: nothing else can pass the idle threshold for a while.
            self._next_reclaim[key] = time.monotonic() + self.reclaim_idle_ms / 4000
        if deleted:
            # Pending entries whose data was deleted from the stream; Redis already dropped them
            # from the pending list, and there is nothing left to deliver or dead-letter.
            _log(logging.WARNING, "bus.reclaim_deleted", stream=stream, group=group, count=len(deleted))
        entries = [(rid, f) for rid, f in entries if rid is not None]
        if not entries:
            return []
        ids = [_s(rid) for rid, _ in entries]
        counts = await self._delivery_counts(stream, group, consumer, ids)
        out: list[Message] = []
        for (_, fields), msg_id in zip(entries, ids, strict=True):
            n = counts.get(msg_id)
            if n is None:
                # Acked or taken by someone else between the claim and the lookup: not ours.
                continue
            _log(
                logging.INFO,
                "bus.reclaimed",
                stream=stream,
                group=group,
                consumer=consumer,
                id=msg_id,
                deliveries=n,
            )
            if n > self.max_deliveries:
                # The claim itself counted as delivery n; the message was handed out n-1 times.
                await self._dead_letter_raw(
                    stream,
                    msg_id,
                    group,
                    n - 1,
                    _field(fields, DATA_FIELD) or b"",
                    _decode_headers_lenient(fields),
                    f"max_deliveries: not acknowledged after {n - 1} deliveries"
                    f" (max_deliveries={self.max_deliveries})",
                )
                continue
            msg = await self._accept(stream, group, msg_id, fields, deliveries=n)
            if msg is not None:
                out.append(msg)
        return out

    async def _delivery_counts(
        self, stream: str, group: str, consumer: str, ids: list[str]
    ) -> dict[str, int]:
        # XAUTOCLAIM does not report delivery counts; read them back from XPENDING now that these
        # entries are in our own pending list (one exact-id lookup each, pipelined).
        async with self._client.pipeline(transaction=False) as pipe:
            for msg_id in ids:
                pipe.xpending_range(stream, group, msg_id, msg_id, 1, consumername=consumer)
            rows = await self._run("reclaim", pipe.execute())
        counts: dict[str, int] = {}
        for found in rows:
            for row in found:
                counts[_s(row["message_id"])] = int(row["times_delivered"])
        return counts

    async def _accept(
        self, stream: str, group: str, msg_id: str, fields: Mapping[Any, Any] | None, deliveries: int
    ) -> Message | None:
        """Turn a raw entry into a Message, or dead-letter it when it is not one of ours."""
        fields = fields or {}
        data = _field(fields, DATA_FIELD)
        if stream == self.keys.dead:
            # Dead letters are read as they are (the reader only inspects their headers): never
            # dead-letter a dead letter, or an oversized one would feed itself forever.
            return Message(stream=stream, id=msg_id, data=bytes(data or b""),
                           headers=_decode_headers_lenient(fields), deliveries=deliveries)
        reason: str | None = None
        headers: dict[str, str] = {}
        if data is None:
            reason = f"missing_data: entry has no '{DATA_FIELD}' field"
        elif len(data) > self.max_message_bytes:
            reason = f"oversized_message: entry is {len(data)} bytes, over max_message_bytes={self.max_message_bytes}"
        else:
            try:
                headers = {_s(k): bytes(v).decode("utf-8") for k, v in fields.items() if _s(k) != DATA_FIELD}
            except UnicodeDecodeError:
                reason = "bad_header: a header is not valid UTF-8"
        if reason is not None:
            await self._dead_letter_raw(
                stream, msg_id, group, deliveries, data or b"", _decode_headers_lenient(fields), reason
            )
            return None
        assert data is not None
        return Message(stream=stream, id=msg_id, data=bytes(data), headers=headers, deliveries=deliveries)

    async def ack(self, msg: Message, group: str) -> bool:
        """Acknowledge after the result is durably written. False when it was no longer pending
        (already acked, dead-lettered, or its group was lost with Redis's data): harmless."""
        n = int(await self._run("ack", self._client.xack(msg.stream, group, msg.id)))
        if not n:
            _log(logging.INFO, "bus.ack_not_pending", stream=msg.stream, group=group, id=msg.id)
        return bool(n)

    async def dead_letter(self, msg: Message, group: str, reason: str) -> None:
        """Move a message this consumer cannot process (e.g. a validation failure) to the
        dead-letter stream with `reason`, and ack it in `group` so it is not redelivered."""
        await self._dead_letter_raw(msg.stream, msg.id, group, msg.deliveries, msg.data, msg.headers, reason)

    async def _dead_letter_raw(
        self,
        stream: str,
        msg_id: str,
        group: str,
        deliveries: int,
        data: bytes,
        headers: Mapping[str, str],
        reason: str,
    ) -> None:
        kept = bytes(data[: self._dead_data_max_bytes])
        record: dict[FieldT, EncodableT] = {
            "reason": reason[:MAX_REASON_CHARS],
            "stream": stream,
            "id": msg_id,
            "group": group,
            "deliveries": str(deliveries),
            "data_bytes": str(len(data)),
            "truncated": "1" if len(kept) < len(data) else "0",
            "dead_at_ms": str(int(time.time() * 1000)),
            DATA_FIELD: kept,
        }
        for name, value in headers.items():
            record[DEAD_HEADER_PREFIX + name] = value
        # One MULTI/EXEC: the record and the ack land together, so a crash in between can neither
        # lose the message (acked, no record) nor leave it pending to be dead-lettered again.
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.dead, record)
            pipe.xack(stream, group, msg_id)
            await self._run("dead_letter", pipe.execute())
        _log(
            logging.WARNING,
            "bus.dead_letter",
            stream=stream,
            group=group,
            id=msg_id,
            deliveries=deliveries,
            reason=reason[:200],
        )

    # -- backpressure -----------------------------------------------------------------------------
    async def group_backlog(self, stream: str, group: str) -> tuple[int, int]:
        """(lag, pending) of one group: entries not yet delivered, and delivered but not acked."""
        return (await self._backlogs(stream, [group]))[group]

    async def fill_ratio(self, stream: str, groups: Sequence[str], capacity: int) -> float:
        """The slowest group's (lag + pending) / capacity; the actor pauses above the high watermark."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not groups:
            return 0.0
        backlogs = await self._backlogs(stream, groups)
        return max(lag + pending for lag, pending in backlogs.values()) / capacity

    async def backlog(self, stream: str, groups: Sequence[str]) -> int:
        """Entries some of `groups` has not yet acknowledged (the largest lag + pending)."""
        if not groups:
            return 0
        return max(lag + pending for lag, pending in (await self._backlogs(stream, groups)).values())

    async def _backlogs(self, stream: str, groups: Sequence[str]) -> dict[str, tuple[int, int]]:
        infos = await self._group_infos(stream)
        out: dict[str, tuple[int, int]] = {}
        for group in groups:
            info = infos.get(group)
            if info is None:
                # A missing group will be (re)created at id 0 and then owes the whole stream.
                length = int(await self._run("backlog", self._client.xlen(stream)))
                out[group] = (length, 0)
                continue
            lag = info.get("lag")
            if lag is None:
                # Redis < 7 has no lag; Redis 7 reports nil after deletions inside the range.
                lag = await self._count_after(stream, _s(info["last-delivered-id"]))
            out[group] = (int(lag), int(info["pending"]))
        return out

    async def _count_after(self, stream: str, last_id: str) -> int:
        entries = await self._run(
            "backlog", self._client.xrange(stream, min=f"({last_id}", max="+", count=LAG_SCAN_CAP)
        )
        return len(entries or [])

    async def _group_infos(self, stream: str) -> dict[str, dict[str, Any]]:
        try:
            infos = await self._run("group_info", self._client.xinfo_groups(stream))
        except rexc.ResponseError as err:
            if "no such key" in str(err).lower():
                return {}
            raise
        return {_s(info["name"]): info for info in infos}

    # -- results ----------------------------------------------------------------------------------
    async def put_result_if_absent(self, stage: str, batch_id: str, data: bytes) -> bool:
        """Write a stage's result once; a redelivered message's second write returns False and
        leaves the first result in place (exactly-once effect on top of at-least-once delivery)."""
        if len(data) > self.max_message_bytes:
            raise MessageTooLarge(
                f"result for {stage}/{batch_id} is {len(data)} bytes, over flow.max_message_bytes="
                f"{self.max_message_bytes}"
            )
        key = self.keys.result(stage, batch_id)
        ok = await self._run(
            "put_result", self._client.set(key, bytes(data), nx=True, px=self._result_ttl_ms)
        )
        if not ok:
            _log(logging.INFO, "bus.result_exists", stage=stage, batch_id=batch_id)
        return bool(ok)

    async def get_result(self, stage: str, batch_id: str) -> bytes | None:
        value = await self._run("get_result", self._client.get(self.keys.result(stage, batch_id)))
        return None if value is None else value if isinstance(value, bytes) else value.encode()

    # -- acknowledged versions --------------------------------------------------------------------
    async def set_versions(self, versions: Mapping[str, int]) -> None:
        """Publish the versions the controller has acknowledged per trainable service, so a
        replacement can tell when it has caught up (it reports ready only at the current version)."""
        if versions:
            await self._run("set_versions", self._client.hset(
                f"{self.keys.prefix}:versions", mapping={k: int(v) for k, v in versions.items()}))

    async def get_versions(self) -> dict[str, int]:
        raw = await self._run("get_versions", self._client.hgetall(f"{self.keys.prefix}:versions"))
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}

    # -- housekeeping -----------------------------------------------------------------------------
    async def trim_acked(self, stream: str) -> int:
        """Drop entries every group has acknowledged; returns how many were removed.

        The bound is the smallest id still needed by any group: its oldest pending entry, or the
        entry after its last-delivered id. Both only move forward, so reading them slightly before
        the XTRIM can only make the trim more conservative. A stream without groups is never
        trimmed (nothing says its entries were consumed), nor is one where a group this process
        created has gone missing."""
        infos = await self._group_infos(stream)
        if not infos:
            return 0
        missing = self._groups.get(stream, set()) - set(infos)
        if missing:
            _log(logging.WARNING, "bus.trim_skipped", stream=stream, missing_groups=",".join(sorted(missing)))
            return 0
        async with self._client.pipeline(transaction=False) as pipe:
            for group in infos:
                pipe.xpending(stream, group)
            summaries = await self._run("trim", pipe.execute())
        bound: tuple[int, int] | None = None
        for (_, info), summary in zip(infos.items(), summaries, strict=True):
            need = _next_id(_parse_id(_s(info["last-delivered-id"])))
            if int(summary["pending"]) and summary["min"] is not None:
                need = min(need, _parse_id(_s(summary["min"])))
            bound = need if bound is None else min(bound, need)
        assert bound is not None
        removed = int(
            await self._run(
                "trim",
                self._client.xtrim(stream, minid=f"{bound[0]}-{bound[1]}", approximate=False),
            )
        )
        if removed:
            _log(logging.INFO, "bus.trimmed", stream=stream, removed=removed, min_id=f"{bound[0]}-{bound[1]}")
        return removed

    async def stream_depths(self) -> dict[str, int]:
        """Entries per stream of this run, by short name (prompts, rollouts, scores, dead)."""
        names = self.keys.streams()
        async with self._client.pipeline(transaction=False) as pipe:
            for key in names.values():
                pipe.xlen(key)
            lengths = await self._run("stream_depths", pipe.execute())
        return {name: int(n) for name, n in zip(names, lengths, strict=True)}

    # -- plumbing ---------------------------------------------------------------------------------
    async def _run(self, op: str, call: Awaitable[T], *, extra_s: float = 0.0) -> T:
        """Await one Redis call, bounded in time, mapping connectivity failures to BusUnavailable."""
        try:
            return await asyncio.wait_for(call, self._op_timeout_s + extra_s)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as err:
            # asyncio.TimeoutError is the builtin TimeoutError (an OSError) on Python 3.11.
            detail = str(err) or type(err).__name__
            if self._password:
                detail = detail.replace(self._password, "***")
            raise BusUnavailable(
                self.endpoint, f"Redis at {self.endpoint} is unavailable during {op}: {detail}"
            ) from err
        except rexc.ResponseError as err:
            if str(err).startswith("OOM"):
                # noeviction and full: same remedy for callers as an outage (hold work, retry).
                raise BusUnavailable(
                    self.endpoint, f"Redis at {self.endpoint} is out of memory (maxmemory) during {op}"
                ) from err
            raise


# -- helpers -----------------------------------------------------------------------------------
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


def _log(level: int, event: str, **fields: object) -> None:
    """One structured record: the event name as the message, ids and counts as `extra` fields
    (the project's JSON formatter turns them into keys). Never pass payloads here."""
    if log.isEnabledFor(level):
        # A field named like a LogRecord attribute would make logging raise; suffix it instead.
        extra = {(f"{k}_" if k in _RECORD_ATTRS else k): v for k, v in fields.items() if v is not None}
        log.log(level, event, extra=extra)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def _check_name(kind: str, name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(f"{kind} name must match {_NAME_RE.pattern}, got {name!r}")


def _endpoint_from_url(url: str) -> str:
    """host:port of a redis:// URL, for error messages (never the credentials)."""
    try:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return f"unix:{parts.path}"
        return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
    except ValueError:
        return "<unparsable redis url>"


def _encode_headers(headers: Mapping[str, str]) -> dict[FieldT, EncodableT]:
    if len(headers) > MAX_HEADERS:
        raise ValueError(f"at most {MAX_HEADERS} headers, got {len(headers)}")
    out: dict[FieldT, EncodableT] = {}
    for name, value in headers.items():
        if not _HEADER_RE.match(name) or name == DATA_FIELD:
            raise ValueError(
                f"header name must match {_HEADER_RE.pattern} and not be '{DATA_FIELD}': {name!r}"
            )
        if not isinstance(value, str):
            raise TypeError(f"header {name!r} must be a str, got {type(value).__name__}")
        if len(value) > MAX_HEADER_VALUE_CHARS:
            raise ValueError(f"header {name!r} is {len(value)} characters, over {MAX_HEADER_VALUE_CHARS}")
        out[name.encode()] = value.encode()
    return out


def _decode_headers_lenient(fields: Mapping[Any, Any] | None) -> dict[str, str]:
    """Headers for a dead-letter record: best effort, a bad byte must not stop dead-lettering."""
    out: dict[str, str] = {}
    for k, v in (fields or {}).items():
        name = bytes(k).decode("utf-8", "replace") if isinstance(k, bytes | bytearray) else str(k)
        if name != DATA_FIELD:
            out[name] = bytes(v).decode("utf-8", "replace")[:MAX_HEADER_VALUE_CHARS]
    return out


def _field(fields: Mapping[Any, Any], name: str) -> bytes | None:
    value = fields.get(name.encode(), fields.get(name))
    return None if value is None else bytes(value)


def _stream_entries(resp: Any) -> Iterable[tuple[Any, Any]]:
    """Entries of a single-stream XREADGROUP reply (RESP2 shape: [[stream, entries]])."""
    return [entry for _stream, entries in resp or [] for entry in entries]


def _parse_id(msg_id: str) -> tuple[int, int]:
    ms, _, seq = msg_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(msg_id: tuple[int, int]) -> tuple[int, int]:
    ms, seq = msg_id
    return (ms + 1, 0) if seq >= _MAX_SEQ else (ms, seq + 1)
