"""The shape shared by the scoring services (reward, reference, critic): consume the rollouts
stream in the stage's consumer group, score each batch, publish a ScoreBatch, ack."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from services.core.config.run import RunConfig, ServiceName
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.serving.runtime import ServiceRuntime
from services.core.serving.worker import StreamWorker
from services.core.transport.bus import Bus, BusUnavailable, Message, bus_options
from services.core.transport.limits import Limits
from services.rl.wire import RolloutArrays, StageScores, parse_message, score_to_proto, validate_rollout_arrays
from services.workers.servicer import ServiceCalls

if TYPE_CHECKING:  # types only: trainable pulls in the checkpoint code (torch DCP, peft), ~3 s of imports
    from services.rl.batch import Rollout
    from services.workers.trainable import Trainable

log = logging.getLogger("rlfleet.scoring")

# A stage's scores [B] or [B, R]; the reward stage may also return its named components [B], or all
# of it with the rows it could not score as StageScores. A scorer that runs a model takes a torch
# Rollout; one that runs none (a reward function) may take the RolloutArrays and return numpy arrays,
# and its service then never imports torch.
ScoreFn = Callable[[Any], Any]


class ScoringService:
    def __init__(self, cfg: RunConfig, stage: ServiceName, score: ScoreFn,
                 version: Callable[[], int] = lambda: 0, trainable: Trainable | None = None,
                 watch: Callable[[], Coroutine[Any, Any, None]] | None = None, arrays: bool = False) -> None:
        self.cfg = cfg
        self.arrays = arrays  # the scorer takes RolloutArrays, not a torch Rollout (see ScoreFn)
        self.watch = watch  # raises when a part of the service (a trainer rank) died: fail fast
        self.trainable = trainable
        self.stage = stage
        self.score_fn = score
        self.version = version
        self.limits = Limits.for_run(cfg)
        self.instance = f"{stage}-{os.getpid()}"
        self.runtime = ServiceRuntime.from_config(
            cfg, stage, readiness=self.readiness, status=self.status, on_drain=self.on_drain,
        )
        self.metrics = self.runtime.metrics
        self.bus: Bus | None = None
        self.worker: StreamWorker | None = None
        # One model, one forward at a time: training (critic) and scoring share it.
        self.model_lock = asyncio.Lock()

    # -- runtime callbacks ---------------------------------------------------------------------------
    async def readiness(self) -> list[str]:
        if self.worker is None:
            return ["connecting to redis"]
        reasons = [] if self.worker.redis_ok else ["redis unreachable"]
        behind = self.trainable.readiness_reason() if self.trainable else None
        return reasons + ([behind] if behind else [])

    async def status(self) -> dict[str, Any]:
        w = self.worker
        return {"stage": self.stage, "version": self.version(), "handled": w.handled if w else 0,
                "in_flight": w.in_flight if w else 0}

    async def on_drain(self) -> None:
        if self.worker is not None:
            await self.worker.drain()
        if self.trainable is not None:
            async with self.trainable.lock:
                await asyncio.to_thread(self.trainable.save)
        if self.bus is not None:
            await self.bus.close()

    # -- the work ------------------------------------------------------------------------------------
    async def handle(self, msg: Message) -> None:
        assert self.bus is not None
        rb = parse_message(pb.RolloutBatch, msg.data, max_bytes=self.cfg.flow.max_message_bytes)
        checked = validate_rollout_arrays(rb, self.cfg.flow.max_message_bytes, self.limits)
        rollout: RolloutArrays | Rollout = checked if self.arrays else checked.to_rollout()
        if self.trainable is not None:
            await self.trainable.until_caught_up()  # a restarted critic scores nothing until replayed
        t0 = time.perf_counter()
        with self.metrics.time_stage(self.stage):
            async with self.model_lock:
                result = await asyncio.to_thread(self.score_fn, rollout)
        if not isinstance(result, StageScores):
            result = StageScores(*result) if isinstance(result, tuple) else StageScores(result)
        parts = result.components
        out = score_to_proto(rb.batch_id, self.stage, rollout.task_ids, result.values, version=self.version(),
                             score_seconds=time.perf_counter() - t0, components=parts if len(parts) > 1 else None,
                             unscored=result.unscored)
        await self.bus.publish(self.bus.keys.scores, out.SerializeToString(), kind="score",
                               stage=self.stage, batch_id=rb.batch_id)
        if result.unscored:
            codes = sorted({r.split(":", 1)[0] for r in result.unscored.values()})
            log.warning("rows unscored", extra={"batch_id": rb.batch_id, "rows": len(rollout),
                                                "unscored": len(result.unscored), "reasons": codes})
        self.metrics.samples.labels(phase="score").inc(len(rollout))
        self.metrics.tokens.labels(phase="score").inc(int(rollout.response_mask.sum()))
        self.metrics.policy_version.set(self.version())

    async def main(self) -> None:
        c = self.cfg
        assert c.redis.url is not None, "redis.url must be resolved before a service starts"
        self.bus = await Bus.connect(c.redis.url, c.run.name, password=c.redis_password(), **bus_options(c.flow))
        await self.bus.ensure_groups(self.bus.keys.rollouts, [self.stage])
        self.worker = StreamWorker(self.bus, self.bus.keys.rollouts, self.stage, self.instance, self.handle,
                                   self.metrics)
        await self.runtime.refresh_readiness()
        follow = asyncio.create_task(self._follow_versions()) if self.trainable else None
        tasks = {asyncio.create_task(self.worker.run())}
        if self.watch is not None:
            tasks.add(asyncio.create_task(self.watch()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            if follow is not None:
                follow.cancel()

    async def _follow_versions(self) -> None:
        assert self.bus is not None and self.trainable is not None
        while True:
            try:
                await self.trainable.follow_committed(self.bus)
            except BusUnavailable:
                pass
            await asyncio.sleep(1.0)

    # -- gRPC ----------------------------------------------------------------------------------------
    def run(self, register: Callable[[grpc.aio.Server], None] | None = None, grpc_name: str = "") -> None:
        if register is None:
            servicer = _ScorerServicer(self.runtime, self.stage, self.instance, self.version)
            self.runtime.add_grpc_service(
                "rlfleet.v1.Scorer", lambda s: pb_grpc.add_ScorerServicer_to_server(servicer, s))
        else:
            self.runtime.add_grpc_service(grpc_name, register)
        self.runtime.run(self.main)


class _ScorerServicer(ServiceCalls, pb_grpc.ScorerServicer):
    """Reward and reference answer only the shared calls."""
