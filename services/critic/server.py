"""The critic service: values for every rollout (a scoring stage) and value-loss training (`Train`)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from services.core.config import RunConfig
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.scoring import ScoringService
from services.core.servicer import ServiceCalls
from services.core.trainable import Trainable
from services.core.wire import TrainRequest
from services.models.critic import ValueModel
from services.models.roles import critic_path
from services.rl.batch import Rollout
from services.rl.trainer import ValueTrainer


class Critic:
    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
        self.cfg = cfg
        spec = cfg.models.critic or cfg.models.policy
        self.model = ValueModel.from_policy(critic_path(cfg, cfg.models.policy.path), dtype=spec.dtype,  # type: ignore[arg-type]
                                            device=cfg.endpoint("critic").device)
        self.trainer = ValueTrainer(self.model, cfg.algo, seed=cfg.run.seed,
                                    gradient_checkpointing=spec.gradient_checkpointing)
        self.svc = ScoringService(cfg, "critic", self.score, version=lambda: self.t.version)
        self.t = Trainable(cfg, "critic", self.model, self.trainer.opt, limits=self.svc.limits)
        self.svc.trainable = self.t
        self.t.restore()

    @property
    def version(self) -> int:
        return self.t.version

    def score(self, r: Rollout) -> torch.Tensor:
        return self.trainer.score(r)

    async def train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:
        res = await self.t.train(request, context, require=("returns", "values"), apply=self._train_step)
        self.svc.metrics.policy_version.set(self.version)
        return res

    async def _train_step(self, req: TrainRequest) -> dict[str, float]:
        m = self.svc.metrics
        with m.time_stage("critic_train"):
            async with self.svc.model_lock:
                stats = await asyncio.to_thread(self.trainer.train_step, req.rollout, req.step)
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
