"""What the actor and the critic share as trainable services: a version that never goes backwards,
checkpoints on a cadence and on drain, catching up to the controller's committed version, the
Train protocol, and loading weights from a checkpoint path (UpdateWeights).

A restarted service reloads its latest checkpoint; the controller notices its version is behind
the journal's (GetState) and replays the training batches after it, so the service converges to
the current version before it serves again (invariant 4).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import grpc
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from services.core.config.run import RunConfig
from services.core.pb import rlfleet_pb2 as pb
from services.core.transport.bus import Bus
from services.core.transport.limits import Limits
from services.models.checkpoints.checkpoint import (
    CheckpointDiskFull,
    CheckpointError,
    CheckpointMeta,
    load_latest,
    prune,
    save_checkpoint,
    verify_checkpoint,
)
from services.models.checkpoints.layout import META_FILE, MODEL_FILE
from services.models.checkpoints.optim import read_optimizer_state  # reads and checks, touches nothing
from services.models.engine import WeightSyncError
from services.models.engines.hf_engine import load_strict
from services.models.nets.lora import is_lora, load_adapter_state
from services.rl.wire import TrainRequest, WireError, message, train_batch_from_proto

log = logging.getLogger("rlfleet.trainable")

# One optimizer step on a decoded, validated batch; returns its statistics. It must not touch the
# version: Trainable moves it once the step is applied.
ApplyFn = Callable[[TrainRequest], Awaitable[dict[str, float]]]


class Ranks(Protocol):
    """A trainer of several ranks (services.dist.group.RankGroup): checkpoints and weight loads go
    through every rank, since each holds only its shards of `model` and `optimizer`."""

    def write(self, tmp: Path) -> None: ...

    def load(self, meta: CheckpointMeta, opt_state: dict[str, Any] | None) -> None: ...

    def load_weights(self, files: list[Path], opt_state: dict[str, Any] | None) -> None: ...


class WeightsRefused(Exception):
    """An UpdateWeights that cannot be applied; `code` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Trainable:
    def __init__(self, cfg: RunConfig, service: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 limits: Limits | None = None, ranks: Ranks | None = None) -> None:
        self.cfg = cfg
        self.ranks = ranks
        self.service = service
        self.model = model
        self.optimizer = optimizer
        self.limits = limits
        self.root: Path = cfg.checkpoint_dir
        self.version = 0
        self.step = 0
        self.checkpoint_version = 0
        # The version the controller has committed for this service (published in Redis). None
        # until first read: a replacement does not know how far behind its checkpoint is, so it
        # neither reports ready nor serves until it has been replayed up to it.
        self.target_version: int | None = None
        self.lock = asyncio.Lock()  # one Train (or checkpoint) at a time
        # The last step applied and its figures: a controller that crashed after this Train and
        # before committing the step replays it, and its row still gets the step's loss.
        self._last: tuple[int, dict[str, float]] = (0, {})

    def restore(self) -> int:
        meta = load_latest(self.root, self.service, self.model, self.optimizer,
                           rank_load=self.ranks.load if self.ranks is not None else None)
        if meta is not None:
            self.version = self.checkpoint_version = meta.version
            self.step = meta.step
            log.info("restored checkpoint", extra={"service": self.service, "version": meta.version})
        return self.version

    def save(self) -> None:
        """Checkpoint the current version (no-op when it is already on disk)."""
        if self.version == 0 or self.version <= self.checkpoint_version:
            return
        try:
            save_checkpoint(self.root, self.service, self.version, self.step, self.model, self.optimizer,
                            rank_write=self.ranks.write if self.ranks is not None else None)
        except CheckpointDiskFull as err:
            # Training goes on; the checkpoint is due again after the next step, and until one lands
            # the controller keeps the batches a replacement would need.
            log.warning("checkpoint skipped: disk full", extra={"service": self.service, "error": str(err)[:300]})
            return
        self.checkpoint_version = self.version
        prune(self.root, self.service, keep=self.cfg.checkpoint.keep)
        log.info("checkpoint written", extra={"service": self.service, "version": self.version})

    # -- Train ---------------------------------------------------------------------------------------
    async def train(self, request: pb.TrainBatch, context: Any, *, require: Iterable[str],
                    apply: ApplyFn) -> pb.TrainResult:
        """The Train call of every trainable service: validate, gate on the version, apply the
        step, move the version, checkpoint when due. A malformed batch answers INVALID_ARGUMENT."""
        try:
            req = train_batch_from_proto(request, self.cfg.flow.max_message_bytes, require=tuple(require),
                                         limits=self.limits)
        except WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.reason}: {e}")
        async with self.lock:
            done = await self.gate(req.step, req.target_version, context)
            if done is not None:
                return done
            t0 = time.perf_counter()
            stats = await apply(req)
            self.version, self.step = req.target_version, req.step
            self._last = (req.target_version, dict(stats))
            if self.due():
                await asyncio.to_thread(self.save)
        return message(pb.TrainResult, step=req.step, version=self.version, stats=stats,
                       train_seconds=time.perf_counter() - t0)

    async def gate(self, step: int, target_version: int, context: Any) -> pb.TrainResult | None:
        """Train is keyed by the version it produces, which makes it idempotent: None means apply
        it; a result means it is already in these weights (a replay); a gap aborts the call with
        FAILED_PRECONDITION, which tells the controller to replay the missing steps first.
        Call with `self.lock` held."""
        if self.version >= target_version:
            version, stats = self._last
            return message(pb.TrainResult, step=step, version=self.version, replayed=True,
                           stats=stats if version == target_version else {})
        if target_version != self.version + 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{self.service} at version {self.version} cannot apply a step targeting "
                                f"{target_version}: replay the missing steps first")
        return None

    def due(self) -> bool:
        return self.version - self.checkpoint_version >= self.cfg.checkpoint.every

    # -- UpdateWeights -------------------------------------------------------------------------------
    def check_weights_version(self, version: int, committed: int) -> None:
        """Weights from a path move the version like a Train would: never backwards, never past
        what the controller has committed (it could not replay them after a restart)."""
        if version < self.version:
            raise WeightsRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"version {version} is behind {self.service}'s version {self.version}:"
                                 " versions never go backwards")
        if version > committed:
            raise WeightsRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"version {version} is ahead of the run's committed version {committed}")

    def load_weights(self, path: Path, version: int) -> int:
        """Load the weights at `path` into the model, all or nothing, and move to `version`; returns
        the step recorded. `path` is a checkpoint directory as `save_checkpoint` writes it (its
        meta.json must say `version`; its optimizer state comes along) or a `save_pretrained`
        directory of safetensors (the optimizer's moments are reset: they belong to other weights).
        Call with `self.lock` held, off the event loop; the version gate is the caller's."""
        step = max(version - 1, 0)
        opt_state = None
        try:
            if (path / META_FILE).is_file():
                meta = verify_checkpoint(path, self.service)
                if meta.version != version:
                    raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"{path} holds {self.service} version {meta.version}, not {version}")
                step = meta.step
                if meta.has_optimizer:
                    opt_state = read_optimizer_state(path, self.optimizer)
                files = [path / MODEL_FILE]
            elif is_lora(self.model):
                raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"{path} is not an rlfleet checkpoint: a LoRA {self.service} loads its"
                                     " adapters from its own checkpoints only")
            else:
                files = _safetensors_files(path)
            if self.ranks is not None:
                # Every rank loads its shards; the names are checked before any rank copies one.
                self.ranks.load_weights(files, opt_state)
            else:
                tensors: dict[str, torch.Tensor] = {}
                for f in files:
                    tensors.update(load_file(str(f)))
                if is_lora(self.model):
                    load_adapter_state(self.model, tensors)  # type: ignore[arg-type]
                else:
                    load_strict(self.model, tensors)  # checks every name and shape before it copies any
        except (CheckpointError, WeightSyncError, SafetensorError, OSError) as err:
            raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: {err}") from None
        if self.ranks is None:
            if opt_state is not None:
                self.optimizer.load_state_dict(opt_state)
            else:
                self.optimizer.state.clear()
        self.version, self.step = version, step
        log.info("weights loaded", extra={"service": self.service, "version": version, "path": str(path)})
        return step

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


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files of a `save_pretrained` directory: one model.safetensors, or the shards its
    index names. Pickled weights (pytorch_model.bin) are never loaded."""
    if not path.is_dir():
        raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{path} is not a directory")
    single = path / MODEL_FILE
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{index} is malformed: {err}") from None
        files = [path / s for s in shards]
        if any(f.parent != path or not f.is_file() for f in files):
            raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{index} names shards missing from {path}")
        return files
    raise WeightsRefused(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{path} holds neither an rlfleet checkpoint ({META_FILE}) nor safetensors weights")
