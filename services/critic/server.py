"""The critic service: values for every rollout (a scoring stage) and value-loss training (`Train`)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import torch

from services.core.config.run import RunConfig
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.dist.build import build_model, build_trainer
from services.dist.group import RankGauges, RankGroup
from services.dist.nodes import world_size
from services.dist.protocol import Op, RankError
from services.models.nets.critic import ValueModel
from services.rl.batch import Rollout
from services.rl.trainer import ValueTrainer
from services.rl.wire import TrainRequest
from services.workers.scoring import ScoringService
from services.workers.servicer import ServiceCalls
from services.workers.trainable import Trainable


class Critic:
    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
        self.cfg = cfg
        # Several trainer ranks: this process is rank 0 of a group it starts here (main thread).
        self.ranks = RankGroup(cfg, "critic") if world_size(cfg, "critic") > 1 else None
        if self.ranks is not None:
            model, trainer = self.ranks.trainer.model, self.ranks.trainer.trainer
        else:
            model = build_model(cfg, "critic", cfg.endpoint("critic").device)
            trainer = build_trainer(cfg, "critic", model)
        assert isinstance(model, ValueModel) and isinstance(trainer, ValueTrainer)
        self.model, self.trainer = model, trainer
        self.svc = ScoringService(cfg, "critic", self.score, version=lambda: self.t.version,
                                  watch=self.watch_ranks if self.ranks is not None else None)
        self.t = Trainable(cfg, "critic", self.model, self.trainer.opt, limits=self.svc.limits, ranks=self.ranks)
        self.svc.trainable = self.t
        self.rank_gauges = RankGauges(self.svc.metrics.registry) if self.ranks is not None else None
        self.t.restore()

    @property
    def version(self) -> int:
        return self.t.version

    async def watch_ranks(self) -> None:
        """Fail fast when a trainer rank has died: the supervisor restarts the whole service."""
        assert self.ranks is not None
        while self.ranks.alive:
            await asyncio.sleep(1.0)
        if self.svc.runtime.draining:
            return  # the drain stopped the ranks: nothing died
        raise RankError(self.ranks.why_dead())

    @torch.no_grad()
    def score(self, r: Rollout) -> torch.Tensor:
        if self.ranks is not None:
            values: torch.Tensor = self.ranks.call(Op.SCORE, r)
            return values
        return self.trainer.score(r)

    async def train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:
        try:
            res = await self.t.train(request, context, require=("returns", "values"), apply=self._train_step)
        except RankError as e:
            # The critic is going down (watch_ranks): the controller retries on its replacement.
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.svc.metrics.policy_version.set(self.version)
        return res

    async def _train_step(self, req: TrainRequest) -> dict[str, float]:
        m = self.svc.metrics
        with m.time_stage("critic_train"):
            async with self.svc.model_lock:
                if self.ranks is not None:
                    stats = await asyncio.to_thread(self.ranks.train, req.rollout, req.step, self.version)
                else:
                    stats = await asyncio.to_thread(self.trainer.train_step, req.rollout, req.step)
        if self.ranks is not None and self.rank_gauges is not None:
            self.rank_gauges.show(self.ranks.ranks)
        m.loss.labels(kind="value").set(stats.get("value_loss", 0.0))
        m.samples.labels(phase="train").inc(len(req.rollout))
        return stats


class _CriticServicer(ServiceCalls, pb_grpc.CriticServicer):
    def __init__(self, critic: Critic) -> None:
        svc = critic.svc
        super().__init__(svc.runtime, "critic", svc.instance, lambda: critic.version, critic.t)
        self.c = critic

    async def Train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:  # noqa: N802
        return await self.c.train(request, context)


def serve(cfg: RunConfig) -> None:
    critic = Critic(cfg)
    servicer = _CriticServicer(critic)
    critic.svc.run(lambda s: pb_grpc.add_CriticServicer_to_server(servicer, s), grpc_name="rlfleet.v1.Critic")
