"""The one place a trainable service's model and trainer are built, by rank 0 and by every
follower alike: ranks must hold the same architecture, initial weights and optimizer."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from services.core.config.run import RunConfig, ServiceName
from services.models.nets.critic import ValueModel
from services.models.nets.lora import load_policy
from services.models.roles.resolve import critic_path
from services.dist.nodes import world_size
from services.rl.trainer import PolicyTrainer, ValueTrainer

Trainer = PolicyTrainer | ValueTrainer


def build_model(cfg: RunConfig, service: ServiceName, device: str) -> nn.Module:
    assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
    path = Path(cfg.models.policy.path)
    if service == "actor":
        # A LoRA policy (one rank only: the config refuses it on more) is the base plus its adapters.
        return load_policy(cfg.models.policy, path, device, cfg.run.seed)
    spec = cfg.models.critic or cfg.models.policy
    return ValueModel.from_policy(critic_path(cfg, path), dtype=spec.dtype, device=device)  # type: ignore[arg-type]


def build_trainer(cfg: RunConfig, service: ServiceName, model: nn.Module) -> Trainer:
    """The trainer (and its optimizer) over `model` as it is now: build it after sharding, since
    FSDP2 replaces the parameters an optimizer would hold."""
    if service == "actor":
        return PolicyTrainer(model, cfg.algo, cfg.generation.temperature, seed=cfg.run.seed,
                             gradient_checkpointing=cfg.models.policy.gradient_checkpointing,
                             behaviour_logprobs=cfg.generation.behaviour_logprobs,
                             ranks=world_size(cfg, service), max_staleness=cfg.flow.max_staleness)
    spec = cfg.models.critic or cfg.models.policy
    assert isinstance(model, ValueModel)
    return ValueTrainer(model, cfg.algo, seed=cfg.run.seed, gradient_checkpointing=spec.gradient_checkpointing)


def rank_device(device: str, rank: int) -> str:
    """Rank r trains on the r-th visible GPU (the device group sets CUDA_VISIBLE_DEVICES)."""
    return f"cuda:{rank}" if device.startswith("cuda") else device
