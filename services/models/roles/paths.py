"""Where a role's model lives: resolve its local directory, building a tiny model there when asked.

Also reads the `rlfleet_model.json` a tiny-model build leaves (task, spec, seed, warm-up results),
which tells a directory we built apart from a foreign one and catches a stale build.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from services.core.config.run import ModelSpec
from services.models.errors import ModelLoadError
from services.models.io.atomic import read_model_info
from services.tasks.base import Task

log = logging.getLogger(__name__)


def _spec_mismatch(info: dict[str, Any], spec: ModelSpec, task: Task, seed: int) -> list[str]:
    assert spec.build is not None
    want = {"task": task.name, "task_params": dict(task.params), "spec": spec.build.model_dump(), "seed": seed}
    return [k for k, v in want.items() if info.get(k) != v]


def model_dir(spec: ModelSpec, role: str, run_dir: Path) -> Path:
    """Where `role`'s model lives: `spec.path`, else `run_dir/models/<role>`."""
    return Path(spec.path) if spec.path is not None else Path(run_dir) / "models" / role


def given_by_path(spec: ModelSpec, role: str, run_dir: Path) -> bool:
    """A model the user supplied as a directory that exists: nothing to build or convert, so the
    launcher need not import the model code (seconds of torch and transformers) before it starts
    services. A directory a tiny-model build left is not "given": its spec is checked on resolve."""
    path = model_dir(spec, role, run_dir)
    return spec.gguf_file is None and spec.build is None and path.is_dir() and any(path.iterdir())


def resolve_model_path(spec: ModelSpec, role: str, task: Task, run_dir: Path, seed: int) -> Path:
    """The local directory of the model for `role`, building a tiny model there when asked to.

    `spec.path` (or `run_dir/models/<role>` when unset) is returned as is when it exists. When it does
    not and `spec.build` is set, a tiny model is built there (a sequence classifier for role "reward",
    a causal LM otherwise). A directory we built for a different task, spec or seed is an error rather
    than a silent reuse of the wrong model.
    """
    path = model_dir(spec, role, run_dir)
    if spec.gguf_file is not None:
        from services.models.io.gguf_model import materialize_gguf  # builders import transformers' models (~2 s)

        return materialize_gguf(Path(spec.gguf_file), path, role)
    empty_dir = path.is_dir() and not any(path.iterdir())
    if path.exists() and not empty_dir:
        if not path.is_dir():
            raise ModelLoadError(f"models.{role}: path {path} is not a directory")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"models.{role}: {path} exists but has no config.json (not a model directory)")
        info = read_model_info(path)
        if spec.build is not None and info is not None:
            diff = _spec_mismatch(info, spec, task, seed)
            if diff:
                raise ModelLoadError(
                    f"models.{role}: {path} holds a tiny model built with a different {', '.join(diff)};"
                    f" delete it to rebuild, or point models.{role}.path elsewhere"
                )
        return path
    if spec.build is None:
        state = "is empty" if empty_dir else "does not exist"
        raise ModelLoadError(f"models.{role}: model directory {path} {state} and models.{role}.build"
                             " is not set (set 'build' to build a tiny model there)")
    log.info("building tiny %s model for role %s at %s", spec.build.arch, role, path)
    if role == "reward":
        from services.models.roles.reward_model import build_tiny_reward_model

        return build_tiny_reward_model(task, path, seed, spec.build)
    from services.models.roles.tiny import build_tiny_model

    return build_tiny_model(task, spec.build, path, seed)
