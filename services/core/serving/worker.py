"""A consumer loop over one stream and one consumer group, with the fleet's delivery rules:
ack only after the handler's result is durably written, dead-letter a bad message with a named
reason (the service keeps running), and ride out a Redis outage instead of crashing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.core.journal.lmdb_store import StoreFull
from services.core.observability.metrics import ServiceMetrics
from services.core.retry import Policy
from services.core.transport.bus import Bus, BusUnavailable, Message
from services.core.transport.codec import WireError

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
# Every wait of the worker: for as long as the outage lasts (the work is durable; giving up would only
# crash the service). Waits that hold a message also end when the worker stops: it stays pending.
UNTIL_BACK = Policy(retry_on=TRANSIENT)


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
        gate: Callable[[], Awaitable[int | None]] | None = None,
        together: bool = False,
    ) -> None:
        self.bus, self.stream, self.group, self.consumer = bus, stream, group, consumer
        self.handle = handle
        self.metrics = metrics
        self.count, self.block_ms = count, block_ms
        # Awaited before each read: backpressure holds the worker here, and may bound how many messages
        # the read takes (its int result; None: `count`), so a read of many never overshoots the hold.
        self.gate = gate
        # Handle the messages of one read side by side (each acked or dead-lettered on its own), so a
        # handler can batch their work; else one after another.
        self.together = together
        self._stop = asyncio.Event()
        self.in_flight = 0
        self.handled = 0
        self.redis_ok = True

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _on_transient(self, err: BaseException) -> None:
        self.redis_ok = not isinstance(err, BusUnavailable)

    async def _read(self) -> list[Message]:
        room = await self.gate() if self.gate is not None else None
        if self._stop.is_set():
            return []
        count = self.count if room is None else max(1, min(self.count, room))
        return await self.bus.read(self.stream, self.group, self.consumer, count, self.block_ms)

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                msgs = await UNTIL_BACK.call(self._read, what=f"read {self.stream}", stop=self._stop,
                                             on_retry=self._on_transient)
            except TRANSIENT:
                break  # stopped while Redis was away
            self.redis_ok = True
            if self.together and len(msgs) > 1:
                await self._process_together(msgs)
            else:
                for msg in msgs:
                    await self._process(msg)

    async def _process_together(self, msgs: list[Message]) -> None:
        tasks = [asyncio.create_task(self._process(m)) for m in msgs]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed (fail fast): none of the others goes on unsupervised; theirs stay pending
            for t in tasks:
                t.cancel()

    async def _process(self, msg: Message) -> None:
        self.in_flight += 1
        try:
            try:
                # "Not now" failures are retried in place; if the worker is stopped meanwhile, the
                # message stays pending for a replacement.
                await UNTIL_BACK.call(lambda: self.handle(msg), what=f"handle {self.stream}", stop=self._stop,
                                      on_retry=self._on_transient)
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
                await UNTIL_BACK.call(lambda: self.bus.dead_letter(msg, self.group, why), what="dead-letter",
                                      on_retry=self._on_transient)
                return
            # The result is already durable: an ack lost to an outage is retried even while stopping,
            # and if we die first the entry is redelivered and deduplicated downstream.
            await UNTIL_BACK.call(lambda: self.bus.ack(msg, self.group), what="ack", on_retry=self._on_transient)
            self.handled += 1
        finally:
            self.in_flight -= 1

    async def drain(self, timeout_s: float = 60.0) -> None:
        self.stop()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
