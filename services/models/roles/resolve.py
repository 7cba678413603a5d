"""The models of a run's roles: resolve (and if needed build) them once, and where each role's lives.

Every entry point that starts a run (`rlfleet up`, `rlfleet train --local`, `python -m
services.prepare`) calls `prepare` before anything else reads a model, so no two processes race to
build the same tiny model; the services then only read the paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.core.config.run import RunConfig
from services.models.io.light_tokenizer import load_tokenizer
from services.models.roles.paths import resolve_model_path
from services.tasks import load_task
from services.tasks.base import Task


@dataclass
class Roles:
    """Everything a run needs besides the policy: built once, shared by the local loop's steps."""

    task: Task
    # The controller's tokenizer (services.models.io.light_tokenizer): the local loop encodes prompts and
    # decodes completions through the same code as the fleet.
    tokenizer: object
    policy_path: Path


def prepare(cfg: RunConfig) -> Roles:
    """Resolve (and if needed build) the models; the fleet's `rlfleet up` calls this before starting
    services so no two processes race to build the same model."""
    task = load_task(cfg.task)
    path = resolve_model_path(cfg.models.policy, "policy", task, cfg.run_dir, cfg.run.seed)
    return Roles(task=task, tokenizer=load_tokenizer(path), policy_path=path)


def critic_path(cfg: RunConfig, policy_path: Path) -> Path:
    spec = cfg.models.critic
    if spec is None or spec.path is None:
        return policy_path
    return Path(spec.path)


def import_builders() -> None:
    """Import the model builders `prepare` may call (transformers' model code, ~2 s), which the
    services import lazily: `rlfleet up` imports them where a signal cannot interrupt an import."""
    import services.models.io.gguf_model
    import services.models.roles.reward_model  # noqa: F401  (imports services.models.roles.tiny)
