"""One engine call for the prompt messages that wait together.

The actor's stream worker reads up to `generation.batch_messages` messages at once and runs their
handlers side by side. Each handler validates its message, waits for its version, then asks
`EngineBatcher.generate` for its completions. The batcher makes one engine call of every request
that is waiting when the engine comes free (requests arrive in the same turn of the event loop, or
pile up behind a call or a weight sync): each row keeps its own request's seed (`row_seeds`), so the
completions do not depend on how requests were grouped. A failed joined call is made again one
request at a time, so one bad request fails alone and its neighbours are generated.

Why: a step's prompts travel in several small messages (the unit of scoring and redelivery); one
engine call per message decodes the step's tokens once per message, which paced the step once the
trainer was fast (BENCHMARKS.md, 2026-12-07 late night).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry, Histogram

from services.models.engine import Completion, SamplingParams

EngineCall = Callable[[list[list[int]], SamplingParams], list[Completion]]


@dataclass(frozen=True)
class Generated:
    """One request's completions and the call that made them."""

    completions: list[Completion]
    version: int  # the policy version the engine held for the whole call
    seconds: float  # the engine call's wall time (shared by the requests it joined)
    requests: int  # requests the call joined (1: generated alone)


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    done: asyncio.Future[Generated] = field(repr=False)


def _joinable(params: SamplingParams) -> SamplingParams:
    """What two requests must share to be generated in one call: everything but their seeding."""
    return replace(params, seed=0, first_row=0, row_seeds=())


class EngineBatcher:
    def __init__(self, generate: EngineCall, lock: asyncio.Lock, version: Callable[[], int], max_requests: int,
                 registry: CollectorRegistry | None = None) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self._generate = generate
        self._lock = lock  # the engine's: a weight sync never lands inside a call
        self._version = version
        self._max = max_requests
        self.calls = Histogram("rlfleet_engine_call_messages", "Prompt messages generated per engine call",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._task: asyncio.Task[None] | None = None

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generated:
        done: asyncio.Future[Generated] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(prompts, params, done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        try:
            while self._queue:
                await asyncio.sleep(0)  # handlers started in this turn of the loop join this call
                async with self._lock:
                    if group := self._take():
                        self._running = group
                        await self._call(group)
                        self._running = []
        except asyncio.CancelledError:  # the actor stops: its handlers stop with it
            for r in [*self._running, *self._queue]:
                r.done.cancel()
            raise

    def _take(self) -> list[_Request]:
        """The oldest waiting request and those that can join it, up to the bound, in arrival order.
        Requests whose handler is gone (cancelled) are dropped."""
        waiting = [r for r in self._queue if not r.done.done()]
        if not waiting:
            self._queue = []
            return []
        key = _joinable(waiting[0].params)
        group: list[_Request] = []
        rest: list[_Request] = []
        for r in waiting:
            (group if len(group) < self._max and _joinable(r.params) == key else rest).append(r)
        self._queue = rest
        return group

    async def _call(self, group: list[_Request]) -> None:
        prompts = [p for r in group for p in r.prompts]
        params = group[0].params
        if len(group) > 1:
            params = replace(params, row_seeds=tuple(s for r in group for s in r.params.seeds(len(r.prompts))))
        version = self._version()
        t0 = time.perf_counter()
        try:
            comps = await asyncio.to_thread(self._generate, prompts, params)
            if len(comps) != len(prompts):
                raise RuntimeError(f"the engine returned {len(comps)} completions for {len(prompts)} prompts")
        except Exception as err:
            if len(group) == 1:
                if not group[0].done.done():
                    group[0].done.set_exception(err)
                return
            for r in group:  # one request's fault fails that request alone
                await self._call([r])
            return
        seconds = time.perf_counter() - t0
        self.calls.observe(len(group))
        start = 0
        for r in group:
            n = len(r.prompts)
            if not r.done.done():
                r.done.set_result(Generated(comps[start:start + n], version, seconds, len(group)))
            start += n
