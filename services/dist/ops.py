"""What every rank does for each command: the same op, in the same order, on its share of the
rows. Rank 0 and the followers run exactly this code, so their collectives line up."""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from services.core.config.run import RunConfig, ServiceName
from services.dist.build import Trainer, build_model, build_trainer, rank_device
from services.dist.protocol import Command, Op
from services.dist.shard import rank_split, reduce_stats, shard_model
from services.models.checkpoints.dcp import load_dcp, save_dcp
from services.models.nets.critic import ValueModel
from services.rl.batch import Rollout
from services.rl.trainer import PolicyTrainer

log = logging.getLogger("rlfleet.dist")


class RankTrainer:
    """One rank's sharded model and trainer (an initialised default process group required)."""

    def __init__(self, cfg: RunConfig, service: ServiceName, local_rank: int = 0) -> None:
        self.cfg, self.service = cfg, service
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Global rank node x local + local rank; the device is the local rank's, on its own host.
        self.device = rank_device(cfg.endpoint(service).device, local_rank)
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        model = build_model(cfg, service, self.device)
        self.model: nn.Module = shard_model(model, torch.device(self.device))
        self.trainer: Trainer = build_trainer(cfg, service, self.model)
        self.trainer.split = rank_split(self.rank, self.world)
        self.opt = self.trainer.opt

    def run(self, cmd: Command) -> Any:
        fn = getattr(self, f"op_{cmd.op.value}")
        return fn(*cmd.args)

    # -- ops -----------------------------------------------------------------------------------
    def op_train(self, rollout: Rollout, step: int, version: int) -> tuple[dict[str, float], list[Any]]:
        """The global step's statistics, and every rank's (seconds, memory bytes) on rank 0."""
        t0 = time.perf_counter()
        if isinstance(self.trainer, PolicyTrainer):
            stats = self.trainer.train_step(rollout, step, version)
        else:
            stats = self.trainer.train_step(rollout, step)
        out = reduce_stats(stats, self.world)
        mine = (time.perf_counter() - t0, memory_bytes(self.device))
        gathered: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        return out, gathered

    @torch.no_grad()
    def op_score(self, rollout: Rollout) -> torch.Tensor:
        # Every rank runs every forward (FSDP gathers each block from all ranks); rank 0 keeps the
        # values. Scoring is a small share of the critic's work next to training.
        assert isinstance(self.model, ValueModel)
        micro = self.cfg.algo.micro_batch_size or len(rollout)
        parts = []
        for idx in torch.arange(len(rollout)).split(micro):
            mb = rollout.select(idx).to(self.device)
            parts.append(self.model.values(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask).cpu())
        return torch.cat(parts)

    def op_full_state(self) -> dict[str, Any]:
        # Rank 0 receives the whole state dict on its CPU; the others an empty one.
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def op_save(self, directory: str) -> None:
        save_dcp(Path(directory), self.model, self.opt)

    def op_load(self, path: str, layout: str, opt_state: dict[str, Any] | None) -> None:
        if layout == "dcp":
            load_dcp(Path(path), self.model, self.opt)
        else:
            self.op_load_weights([path], opt_state)

    def op_load_weights(self, files: list[str], opt_state: dict[str, Any] | None) -> None:
        """Full (unsharded) safetensors weights, and optimizer state keyed by parameter index as a
        one-rank checkpoint holds it, into this rank's shards; no optimizer state resets it."""
        full: dict[str, Any] = {}
        for f in files:
            full.update(load_file(f))
        check_names(self.model, full)
        opts = StateDictOptions(full_state_dict=True, strict=False)
        if opt_state is None:
            set_model_state_dict(self.model, full, options=opts)
            self.opt.state.clear()
            return
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        osd: dict[str, Any] = {"state": {names[int(i)]: s for i, s in opt_state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                for g in opt_state["param_groups"]]}
        set_state_dict(self.model, self.opt, model_state_dict=full, optim_state_dict=osd, options=opts)

    def op_stop(self) -> None:
        return None


def check_names(model: nn.Module, full: dict[str, Any]) -> None:
    """Every parameter and buffer present, by one of its names (a one-rank checkpoint stores tied
    weights once), and nothing else; shapes are DCP's to check."""
    by_tensor: dict[int, set[str]] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), set()).add(n)
    known = set().union(*by_tensor.values()) if by_tensor else set()
    extra = sorted(set(full) - known)
    missing = sorted(min(names) for names in by_tensor.values() if not names & set(full))
    if extra or missing:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")


def memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


__all__ = ["Op", "RankTrainer"]
