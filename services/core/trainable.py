"""What the actor and the critic share as trainable services: a version that never goes backwards,
checkpoints on a cadence and on drain, and catching up to the controller's committed version.

A restarted service reloads its latest checkpoint; the controller notices its version is behind
the journal's (GetState) and replays the training batches after it, so the service converges to
the current version before it serves again (invariant 4).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from services.core.bus import Bus
from services.core.config import RunConfig
from services.core.pb import rlfleet_pb2 as pb
from services.core.wire import message
from services.models.checkpoint import latest_meta, load_latest, prune, save_checkpoint

log = logging.getLogger("rlfleet.trainable")


class Trainable:
    def __init__(self, cfg: RunConfig, service: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.cfg = cfg
        self.service = service
        self.model = model
        self.optimizer = optimizer
        self.root: Path = cfg.checkpoint_dir
        self.version = 0
        self.step = 0
        self.checkpoint_version = 0
        # The version the controller has committed for this service (published in Redis). None
        # until first read: a replacement does not know how far behind its checkpoint is, so it
        # neither reports ready nor serves until it has been replayed up to it.
        self.target_version: int | None = None
        self.lock = asyncio.Lock()  # one Train (or checkpoint) at a time

    def restore(self) -> int:
        meta = load_latest(self.root, self.service, self.model, self.optimizer)
        if meta is not None:
            self.version = self.checkpoint_version = meta.version
            self.step = meta.step
            log.info("restored checkpoint", extra={"service": self.service, "version": meta.version})
        return self.version

    def save(self) -> None:
        """Checkpoint the current version (no-op when it is already on disk)."""
        if self.version == 0 or self.version <= self.checkpoint_version:
            return
        save_checkpoint(self.root, self.service, self.version, self.step, self.model, self.optimizer)
        self.checkpoint_version = self.version
        prune(self.root, self.service, keep=self.cfg.checkpoint.keep)
        log.info("checkpoint written", extra={"service": self.service, "version": self.version})

    async def gate(self, step: int, target_version: int, context: Any) -> pb.TrainResult | None:
        """Train is keyed by the version it produces, which makes it idempotent: None means apply
        it; a result means it is already in these weights (a replay); a gap aborts the call with
        FAILED_PRECONDITION, which tells the controller to replay the missing steps first.
        Call with `self.lock` held."""
        if self.version >= target_version:
            return message(pb.TrainResult, step=step, version=self.version, replayed=True)
        if target_version != self.version + 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{self.service} at version {self.version} cannot apply a step targeting "
                                f"{target_version}: replay the missing steps first")
        return None

    def due(self) -> bool:
        return self.version - self.checkpoint_version >= self.cfg.checkpoint.every

    # -- catch-up gate: a restarted service serves nothing older than the fleet committed ------------
    async def follow_committed(self, bus: Bus) -> None:
        """Read the fleet's committed version for this service (raises BusUnavailable)."""
        self.target_version = (await bus.get_versions()).get(self.service, 0)

    @property
    def caught_up(self) -> bool:
        return self.target_version is not None and self.version >= self.target_version

    async def until_caught_up(self, at_least: int = 0) -> None:
        """Hold a consumer until the controller has replayed this service up to the committed
        version, and to `at_least` (the version a message was admitted at)."""
        while not (self.caught_up and self.version >= at_least):
            await asyncio.sleep(0.05)

    def readiness_reason(self) -> str | None:
        if self.caught_up:
            return None
        if self.target_version is None:
            return f"catching up: at version {self.version}, fleet's committed version not read yet"
        return f"catching up: at version {self.version}, fleet at {self.target_version}"

    def on_disk(self) -> int:
        meta = latest_meta(self.root, self.service)
        return meta.version if meta else 0
