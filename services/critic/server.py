"""The critic service: values for every rollout (a scoring stage) and value-loss training (`Train`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import torch

from services.core.config import RunConfig
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.scoring import ScoringService
from services.core.trainable import Trainable
from services.core.wire import WireError, check_schema_version, message, train_batch_from_proto
from services.local import critic_path
from services.models.critic import ValueModel
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
        self.t = Trainable(cfg, "critic", self.model, self.trainer.opt)
        self.t.restore()
        self.svc = ScoringService(cfg, "critic", self.score, version=lambda: self.t.version,
                                  trainable=self.t)

    @property
    def version(self) -> int:
        return self.t.version

    @torch.no_grad()
    def score(self, r: Rollout) -> torch.Tensor:
        device = next(self.model.parameters()).device
        parts = []
        for idx in torch.arange(len(r)).split(self.cfg.algo.micro_batch_size or len(r)):
            mb = r.select(idx).to(device)
            parts.append(self.model.values(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask).cpu())
        return torch.cat(parts)

    async def train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:
        try:
            req = train_batch_from_proto(request, self.cfg.flow.max_message_bytes, require=("returns", "values"))
        except WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.reason}: {e}")
        async with self.t.lock:
            done = await self.t.gate(req.step, req.target_version, context)
            if done is not None:
                return done
            t0 = time.perf_counter()
            m = self.svc.metrics
            with m.time_stage("critic_train"):
                async with self.svc.model_lock:
                    stats = await asyncio.to_thread(self.trainer.train_step, req.rollout, req.step)
            self.t.version, self.t.step = req.target_version, req.step
            if self.t.due():
                await asyncio.to_thread(self.t.save)
        m.policy_version.set(self.version)
        m.loss.labels(kind="value").set(stats.get("value_loss", 0.0))
        m.samples.labels(phase="train").inc(len(req.rollout))
        return message(pb.TrainResult, step=req.step, version=self.version, stats=stats,
                       train_seconds=time.perf_counter() - t0)


class _CriticServicer(pb_grpc.CriticServicer):
    def __init__(self, critic: Critic) -> None:
        self.c = critic

    async def Train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:  # noqa: N802
        return await self.c.train(request, context)

    async def GetState(self, request: pb.GetStateRequest, context: Any) -> pb.ServiceState:  # noqa: N802
        check_schema_version(request)
        return self.c.svc.state_message()

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:  # noqa: N802
        return self.c.svc.drain_rpc(request)


def serve(cfg: RunConfig) -> None:
    critic = Critic(cfg)
    servicer = _CriticServicer(critic)
    critic.svc.run(lambda s: pb_grpc.add_CriticServicer_to_server(servicer, s), grpc_name="rlfleet.v1.Critic")
