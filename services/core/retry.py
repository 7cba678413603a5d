"""The fleet's one retry policy: exponential backoff on failures that say "not now" (Redis away, a
full disk, a peer restarting), forever or until a deadline, and never on anything else.

Built on tenacity. A `Policy` is declared where it is used, next to the call it guards, so a reader
sees what is retried, how long and how fast in one line:

    PUBLISH = Policy(retry_on=(BusUnavailable,))                     # until Redis answers
    TRAIN = Policy(retry_on=grpc_codes(UNAVAILABLE), deadline_s=120)  # until the deadline

    await PUBLISH.call(lambda: bus.publish(...), what="publish prompts")

`call` re-raises the last error when the deadline passes, and the first error that the policy does
not retry at once. A `stop` event ends the waiting early (a draining service): the error that was
being retried is raised then, so the caller decides what a stop means.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import tenacity

log = logging.getLogger("rlfleet.retry")

T = TypeVar("T")
RetryOn = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def grpc_codes(*codes: grpc.StatusCode) -> Callable[[BaseException], bool]:
    """Retry a gRPC call that failed with one of `codes` (the ones that say the peer is away)."""
    wanted = frozenset(codes)
    return lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in wanted


@dataclass(frozen=True)
class Policy:
    retry_on: RetryOn
    initial_s: float = 0.2  # first wait; doubles each attempt up to max_s
    max_s: float = 5.0
    deadline_s: float | None = None  # None: retry for as long as the failure lasts

    def _retries(self, err: BaseException) -> bool:
        if isinstance(self.retry_on, tuple):
            return isinstance(err, self.retry_on)
        return self.retry_on(err)

    async def call(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        what: str,
        stop: asyncio.Event | None = None,
        on_retry: Callable[[BaseException], None] | None = None,
        log_level: int = logging.WARNING,
    ) -> T:
        """Await `fn()` until it succeeds under this policy. `on_retry` sees every retried error
        (to flip a readiness flag, say); the first retry of a streak is logged at `log_level`,
        later ones at debug, so an outage is one line in the log, not one per attempt."""

        def before_sleep(state: tenacity.RetryCallState) -> None:
            err = state.outcome.exception() if state.outcome else None
            if err is None:
                return
            if on_retry is not None:
                on_retry(err)
            level = log_level if state.attempt_number == 1 else logging.DEBUG
            log.log(level, "retrying", extra={"what": what, "attempt": state.attempt_number,
                                              "error": f"{type(err).__name__}: {str(err)[:300]}"})

        stops: list[tenacity.stop.stop_base] = []
        if self.deadline_s is not None:
            stops.append(tenacity.stop_after_delay(self.deadline_s))
        if stop is not None:
            stops.append(_StopOnEvent(stop))
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(self._retries),
            wait=tenacity.wait_exponential(multiplier=self.initial_s, min=self.initial_s, max=self.max_s),
            stop=tenacity.stop_any(*stops) if stops else tenacity.stop_never,
            sleep=_sleeper(stop),
            before_sleep=before_sleep,
            reraise=True,
        )

        async def attempt() -> T:
            # tenacity awaits only coroutine functions; `fn` is often a lambda returning a coroutine.
            return await fn()

        return await retrying(attempt)


class _StopOnEvent(tenacity.stop.stop_base):
    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.event.is_set()


def _sleeper(stop: asyncio.Event | None) -> Callable[[float], Awaitable[Any]]:
    """A backoff sleep that a stop event cuts short (the next stop check then ends the retries)."""
    if stop is None:
        return asyncio.sleep

    async def sleep(seconds: float) -> None:
        try:
            await asyncio.wait_for(stop.wait(), timeout=seconds)
        except TimeoutError:
            pass

    return sleep

