"""A consumer loop over one stream and one consumer group, with the fleet's delivery rules:
ack only after the handler's result is durably written, dead-letter a bad message with a named
reason (the service keeps running), and ride out a Redis outage instead of crashing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_never, wait_exponential

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
    """The dead-letter reason for an error a message's content caused, None for anything else.
    Validation names the field (WireError, Rejected); a ValueError that escaped it still came from
    the message's values, so it is a rejection too: retried, it would crash-loop the service."""
    if isinstance(err, WireError | Rejected):
        return err.reason
    if isinstance(err, ValueError):
        return str(getattr(err, "reason", None) or "invalid_content")
    return None


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

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _backoff(self, *, interruptible: bool) -> AsyncRetrying:
        """One retry policy for every Redis wait of the worker: exponential backoff from 0.2 s to
        5 s, for as long as it takes (the work is durable; giving up would only crash the service).
        An interruptible wait also ends when the worker is stopped: what it held stays pending."""
        return AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT),
            wait=wait_exponential(multiplier=0.2, min=0.2, max=5.0),
            stop=(lambda _: self._stop.is_set()) if interruptible else stop_never,
            sleep=self._sleep if interruptible else asyncio.sleep,
            before_sleep=self._on_transient,
            reraise=True,
        )

    def _on_transient(self, state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome is not None else None
        self.redis_ok = not isinstance(err, BusUnavailable)
        log.warning("dependency unavailable; retrying", extra={"stream": self.stream, "error": str(err)[:300]})

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                async for attempt in self._backoff(interruptible=True):
                    with attempt:
                        if self.gate is not None:
                            await self.gate()
                        msgs = [] if self._stop.is_set() else await self.bus.read(
                            self.stream, self.group, self.consumer, self.count, self.block_ms)
            except TRANSIENT:
                break  # stopped while Redis was away
            self.redis_ok = True
            for msg in msgs:
                await self._process(msg)

    async def _process(self, msg: Message) -> None:
        self.in_flight += 1
        try:
            try:
                # "Not now" failures are retried in place; if the worker is stopped meanwhile, the
                # message stays pending for a replacement.
                async for attempt in self._backoff(interruptible=True):
                    with attempt:
                        await self.handle(msg)
            except TRANSIENT:
                return
            except Exception as err:
                reason = rejection_reason(err)
                if reason is None:
                    raise  # a bug or a dead dependency: fail fast, the message stays pending
                log.warning("message rejected", extra={
                    "stream": self.stream, "group": self.group, "id": msg.id, "reason": reason,
                    "error": str(err)[:500],
                }, exc_info=not isinstance(err, WireError | Rejected))
                self.metrics.dead_letters.labels(reason=reason).inc()
                why = f"{reason}: {err}"
                await self._retrying(lambda: self.bus.dead_letter(msg, self.group, why))
                return
            await self._retrying(lambda: self.bus.ack(msg, self.group))
            self.handled += 1
        finally:
            self.in_flight -= 1

    async def _retrying(self, op: Callable[[], Awaitable[object]]) -> None:
        """The result is already durable; an ack lost to an outage is retried even while stopping,
        and if we die first the entry is redelivered and deduplicated downstream."""
        async for attempt in self._backoff(interruptible=False):
            with attempt:
                await op()

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
