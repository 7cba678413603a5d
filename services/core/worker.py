"""A consumer loop over one stream and one consumer group, with the fleet's delivery rules:
ack only after the handler's result is durably written, dead-letter a bad message with a named
reason (the service keeps running), and ride out a Redis outage instead of crashing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.core.bus import Bus, BusUnavailable, Message
from services.core.codec import WireError
from services.core.lmdb_store import StoreFull
from services.core.metrics import ServiceMetrics

log = logging.getLogger("rlfleet.worker")


class Rejected(ValueError):
    """A message that can never be processed: dead-letter it with `reason`, don't retry."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


Handler = Callable[[Message], Awaitable[None]]

# Failures that say "not now" rather than "never": the handler is retried in place until the
# dependency is back (counting them as failed deliveries would dead-letter good work during an
# outage). If the worker is stopped meanwhile, the message stays pending for a replacement.
TRANSIENT = (BusUnavailable, StoreFull)  # StoreFull: the journal's or the outbox's disk is full


def rejection_reason(err: BaseException) -> str | None:
    if isinstance(err, WireError | Rejected):
        return err.reason
    return getattr(err, "reason", None) if isinstance(err, ValueError) else None


class StreamWorker:
    def __init__(
        self,
        bus: Bus,
        stream: str,
        group: str,
        consumer: str,
        handle: Handler,
        metrics: ServiceMetrics,
        *,
        count: int = 1,
        block_ms: int = 500,
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.bus, self.stream, self.group, self.consumer = bus, stream, group, consumer
        self.handle = handle
        self.metrics = metrics
        self.count, self.block_ms = count, block_ms
        self.gate = gate  # awaited before each read: backpressure holds the worker here
        self._stop = asyncio.Event()
        self.in_flight = 0
        self.handled = 0
        self.redis_ok = True
        self.transient_error: str | None = None

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if self.gate is not None:
                    await self.gate()
                    if self._stop.is_set():
                        break
                msgs = await self.bus.read(self.stream, self.group, self.consumer, self.count, self.block_ms)
                self.redis_ok = True
                backoff = 0.2
            except BusUnavailable as e:
                self.redis_ok = False
                log.warning("redis unavailable; retrying", extra={"stream": self.stream, "error": str(e)})
                await self._sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for msg in msgs:
                await self._process(msg)

    async def _process(self, msg: Message) -> None:
        self.in_flight += 1
        try:
            try:
                backoff = 0.2
                while True:
                    try:
                        await self.handle(msg)
                        break
                    except TRANSIENT as err:
                        self.redis_ok = not isinstance(err, BusUnavailable)
                        self.transient_error = str(err)
                        log.warning("dependency unavailable; retrying the message", extra={
                            "stream": self.stream, "id": msg.id, "error": str(err)[:300]})
                        if self._stop.is_set():
                            return
                        await self._sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
            except Exception as err:
                reason = rejection_reason(err)
                if reason is None:
                    raise  # a bug or a dead dependency: fail fast, the message stays pending
                log.warning("message rejected", extra={
                    "stream": self.stream, "group": self.group, "id": msg.id, "reason": reason,
                    "error": str(err)[:500],
                })
                self.metrics.dead_letters.labels(reason=reason).inc()
                why = f"{reason}: {err}"
                await self._retrying(lambda: self.bus.dead_letter(msg, self.group, why))
                return
            await self._retrying(lambda: self.bus.ack(msg, self.group))
            self.handled += 1
            self.transient_error = None
        finally:
            self.in_flight -= 1

    async def _retrying(self, op: Callable[[], Awaitable[object]]) -> None:
        """The result is already durable; an ack lost to an outage is retried, and if we die first
        the entry is redelivered and deduplicated downstream."""
        backoff = 0.2
        while True:
            try:
                await op()
                return
            except BusUnavailable:
                self.redis_ok = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=s)
        except TimeoutError:
            pass

    async def drain(self, timeout_s: float = 60.0) -> None:
        self.stop()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
