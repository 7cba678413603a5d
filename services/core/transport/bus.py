"""The asynchronous Redis Streams bus between the services (docs/architecture.md, "Contracts").

Streams per run: `rlfleet:<run>:prompts` (group "actor"), `rlfleet:<run>:rollouts` (one group per
scoring stage: fan-out), `rlfleet:<run>:scores` (group "controller") and `rlfleet:<run>:dead`
(dead letters, read by the controller and by people).

Delivery is at-least-once: a consumer acks only after its result is durably written (the
controller's journal keeps results put-if-absent, so a redelivery never counts twice), entries a
dead consumer left pending are reclaimed with XAUTOCLAIM after `reclaim_idle_ms`, and an entry
delivered `max_deliveries` times without an ack moves to the dead-letter stream instead of being
delivered again. Streams are only ever trimmed below the oldest entry some group still needs.

Every Redis failure that means "the bus is not usable right now" surfaces as `BusUnavailable`
(a `ConnectionError`) naming host:port, so callers such as the actor's outbox can hold work and
retry: a lost connection, and refusals that pass by themselves (out of memory, MISCONF when Redis
cannot write its AOF to a full disk, LOADING, READONLY...; `streams.outage_reason`). `connect`
waits for Redis up to `wait_s`, and so do the group set-up calls that follow it, so a service
that (re)starts while Redis is down waits instead of exiting. Payloads are opaque bytes, never
logged. Queue inspection and trimming live in `bus_queues`, names and encoding in `streams`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.typing import EncodableT, FieldT

from services.core.config.run import FlowSection
from services.core.transport.bus_queues import BusQueues
from services.core.transport.streams import (
    CONSUMER_RE,
    DATA_FIELD,
    DEAD_HEADER_PREFIX,
    MAX_REASON_CHARS,
    BusError,
    BusUnavailable,
    Message,
    MessageTooLarge,
    StreamKeys,
    as_str,
    check_name,
    decode_headers_lenient,
    encode_headers,
    endpoint_from_url,
    entry_field,
    log_event,
    outage_reason,
    stream_entries,
)

__all__ = ["Bus", "BusError", "BusUnavailable", "Message", "MessageTooLarge", "StreamKeys", "bus_options"]

T = TypeVar("T")

# How long a starting service waits for Redis before giving up (exit 1, the supervisor restarts
# it): long enough to ride out a Redis restart or a full disk being cleaned up.
STARTUP_WAIT_S: Final = 600.0


def bus_options(flow: FlowSection) -> dict[str, Any]:
    """The `Bus.connect` keyword arguments a service passes: the run config's flow section, and
    waiting for Redis at start-up."""
    return {
        "max_message_bytes": flow.max_message_bytes,
        "max_deliveries": flow.max_deliveries,
        "reclaim_idle_ms": flow.reclaim_idle_ms,
        "wait_s": STARTUP_WAIT_S,
    }


_FLOW_DEFAULTS: Final = FlowSection()


# -- the bus -----------------------------------------------------------------------------------
class Bus(BusQueues):
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
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self._client = client
        self.keys = keys
        self.max_message_bytes = max_message_bytes
        self.max_deliveries = max_deliveries
        self.reclaim_idle_ms = reclaim_idle_ms
        self._op_timeout_s = op_timeout_s
        self._dead_data_max_bytes = max(0, dead_data_max_bytes)
        kw = client.connection_pool.connection_kwargs
        if kw.get("protocol") not in (None, 2, "2") or kw.get("decode_responses"):
            # Reply shapes below are RESP2's, and payloads are bytes.
            raise ValueError("Bus needs a RESP2 client with decode_responses=False")
        host, port = kw.get("host", "localhost"), kw.get("port", 6379)
        self.endpoint = f"unix:{kw['path']}" if kw.get("path") else f"{host}:{port}"
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
        # Until this monotonic time (set by `connect(wait_s=...)`) set-up calls wait for Redis.
        self._startup_until = 0.0

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
        op_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        wait_s: float = 0.0,
    ) -> Bus:
        """Connect and PING; raises `BusUnavailable` naming host:port when Redis is unreachable.

        With `wait_s` > 0 an unreachable Redis is retried with backoff for up to that long (and
        `ensure_groups` keeps waiting until the same deadline), logging "waiting for Redis at
        host:port" each time: a service started while Redis restarts waits instead of exiting.
        Credentials Redis refuses raise `BusError` at once: waiting would not fix them."""
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        keys = StreamKeys(run)
        endpoint = endpoint_from_url(url)
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
            op_timeout_s=op_timeout_s,
        )
        bus._startup_until = time.monotonic() + wait_s
        try:
            await bus._until_startup_deadline("ping", bus.ping)
        except BaseException:
            await client.aclose()
            raise
        log_event(logging.INFO, "bus.connected", endpoint=bus.endpoint, run=run)
        return bus

    async def _until_startup_deadline(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call()`, retrying `BusUnavailable` with backoff until the start-up deadline."""
        delay = 0.2
        while True:
            try:
                return await call()
            except BusUnavailable as err:
                left = self._startup_until - time.monotonic()
                if left <= 0:
                    raise
                wait = min(delay, left)
                # One line, host:port only: `err` is already scrubbed of the password.
                log_event(logging.WARNING, f"waiting for Redis at {self.endpoint}", op=op,
                          retry_in_s=round(wait, 2), left_s=round(left), error=str(err)[:200])
                await asyncio.sleep(wait)
                delay = min(delay * 2, 5.0)

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
            check_name("group", group)
            await self._until_startup_deadline("ensure_groups", functools.partial(self._create_group, stream, group))
            self._groups.setdefault(stream, set()).add(group)

    async def _create_group(self, stream: str, group: str) -> None:
        try:
            await self._run("ensure_groups", self._client.xgroup_create(stream, group, id="0", mkstream=True))
            log_event(logging.INFO, "bus.group_created", stream=stream, group=group)
        except rexc.ResponseError as err:
            if not str(err).startswith("BUSYGROUP"):
                raise

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
        fields = encode_headers(headers)
        fields[DATA_FIELD.encode()] = payload
        # Never MAXLEN here: trimming on publish could drop entries a lagging group still needs.
        raw_id = await self._run("publish", self._client.xadd(stream, fields))
        msg_id = as_str(raw_id)
        log_event(
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
        check_name("group", group)
        if not CONSUMER_RE.match(consumer):
            raise ValueError(f"consumer name must match {CONSUMER_RE.pattern}, got {consumer!r}")
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
                log_event(logging.WARNING, "bus.group_missing", stream=stream, group=group, action="recreate")
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
        for raw_id, fields in stream_entries(resp):
            msg = await self._accept(stream, group, as_str(raw_id), fields, deliveries=1)
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
        cursor, entries = as_str(resp[0]), list(resp[1] or [])
        deleted = list(resp[2]) if len(resp) > 2 and resp[2] else []
        self._claim_cursor[key] = cursor
        if cursor == "0-0" and len(entries) < count:
            # The scan went round: nothing else can pass the idle threshold for a while.
            self._next_reclaim[key] = time.monotonic() + self.reclaim_idle_ms / 4000
        if deleted:
            # Pending entries whose data was deleted from the stream; Redis already dropped them
            # from the pending list, and there is nothing left to deliver or dead-letter.
            log_event(logging.WARNING, "bus.reclaim_deleted", stream=stream, group=group, count=len(deleted))
        entries = [(rid, f) for rid, f in entries if rid is not None]
        if not entries:
            return []
        ids = [as_str(rid) for rid, _ in entries]
        counts = await self._delivery_counts(stream, group, consumer, ids)
        out: list[Message] = []
        for (_, fields), msg_id in zip(entries, ids, strict=True):
            n = counts.get(msg_id)
            if n is None:
                # Acked or taken by someone else between the claim and the lookup: not ours.
                continue
            log_event(
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
                    entry_field(fields, DATA_FIELD) or b"",
                    decode_headers_lenient(fields),
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
                counts[as_str(row["message_id"])] = int(row["times_delivered"])
        return counts

    async def _accept(
        self, stream: str, group: str, msg_id: str, fields: Mapping[Any, Any] | None, deliveries: int
    ) -> Message | None:
        """Turn a raw entry into a Message, or dead-letter it when it is not one of ours."""
        fields = fields or {}
        data = entry_field(fields, DATA_FIELD)
        if stream == self.keys.dead:
            # Dead letters are read as they are (the reader only inspects their headers): never
            # dead-letter a dead letter, or an oversized one would feed itself forever.
            return Message(stream=stream, id=msg_id, data=bytes(data or b""),
                           headers=decode_headers_lenient(fields), deliveries=deliveries)
        reason: str | None = None
        headers: dict[str, str] = {}
        if data is None:
            reason = f"missing_data: entry has no '{DATA_FIELD}' field"
        elif len(data) > self.max_message_bytes:
            reason = f"oversized_message: entry is {len(data)} bytes, over max_message_bytes={self.max_message_bytes}"
        else:
            try:
                headers = {as_str(k): bytes(v).decode("utf-8") for k, v in fields.items() if as_str(k) != DATA_FIELD}
            except UnicodeDecodeError:
                reason = "bad_header: a header is not valid UTF-8"
        if reason is not None:
            await self._dead_letter_raw(
                stream, msg_id, group, deliveries, data or b"", decode_headers_lenient(fields), reason
            )
            return None
        assert data is not None
        return Message(stream=stream, id=msg_id, data=bytes(data), headers=headers, deliveries=deliveries)

    async def ack(self, msg: Message, group: str) -> bool:
        """Acknowledge after the result is durably written. False when it was no longer pending
        (already acked, dead-lettered, or its group was lost with Redis's data): harmless."""
        n = int(await self._run("ack", self._client.xack(msg.stream, group, msg.id)))
        if not n:
            log_event(logging.INFO, "bus.ack_not_pending", stream=msg.stream, group=group, id=msg.id)
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
        log_event(
            logging.WARNING,
            "bus.dead_letter",
            stream=stream,
            group=group,
            id=msg_id,
            deliveries=deliveries,
            reason=reason[:200],
        )

    # -- plumbing ---------------------------------------------------------------------------------
    async def _run(self, op: str, call: Awaitable[T], *, extra_s: float = 0.0) -> T:
        """Await one Redis call, bounded in time, mapping outages to BusUnavailable."""
        try:
            return await asyncio.wait_for(call, self._op_timeout_s + extra_s)
        except (rexc.AuthenticationError, rexc.AuthorizationError) as err:
            # Subclasses of redis-py's ConnectionError, but no outage: waiting would not fix them.
            raise BusError(
                f"Redis at {self.endpoint} refused our credentials during {op} ({type(err).__name__});"
                " check redis.password_env"
            ) from None
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as err:
            # asyncio.TimeoutError is the builtin TimeoutError (an OSError) on Python 3.11.
            detail = str(err) or type(err).__name__
            if self._password:
                detail = detail.replace(self._password, "***")
            raise BusUnavailable(
                self.endpoint, f"Redis at {self.endpoint} is unavailable during {op}: {detail}"
            ) from err
        except rexc.ResponseError as err:
            why = outage_reason(err)
            if why is None:
                raise
            # Same remedy for callers as a dropped connection: hold work, report not ready, retry.
            raise BusUnavailable(self.endpoint, f"Redis at {self.endpoint} {why} during {op}") from err
