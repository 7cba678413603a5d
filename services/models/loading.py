"""Model and tokenizer loading from local directories only (never a hub id), with clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from services.core.config import ModelSpec
from services.models.tiny import read_model_info
from services.tasks.base import Task

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be found, built or loaded; the message names the path."""


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}") from None


def _require_model_dir(path: Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{what} directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{what} path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} directory {path} has no config.json (not a transformers model directory)")
    return path


def _spec_mismatch(info: dict[str, Any], spec: ModelSpec, task: Task, seed: int) -> list[str]:
    assert spec.build is not None
    want = {"task": task.name, "task_params": dict(task.params), "spec": spec.build.model_dump(), "seed": seed}
    return [k for k, v in want.items() if info.get(k) != v]


def resolve_model_path(spec: ModelSpec, role: str, task: Task, run_dir: Path, seed: int) -> Path:
    """The local directory of the model for `role`, building a tiny model there when asked to.

    `spec.path` (or `run_dir/models/<role>` when unset) is returned as is when it exists. When it does
    not and `spec.build` is set, a tiny model is built there (a sequence classifier for role "reward",
    a causal LM otherwise). A directory we built for a different task, spec or seed is an error rather
    than a silent reuse of the wrong model.
    """
    path = Path(spec.path) if spec.path is not None else Path(run_dir) / "models" / role
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
        from services.models.reward_model import build_tiny_reward_model

        return build_tiny_reward_model(task, path, seed, spec.build)
    from services.models.tiny import build_tiny_model

    return build_tiny_model(task, spec.build, path, seed)


# Tokenizer classes that mean "exactly what tokenizer.json says" (our tiny-model tokenizers save as these).
_PLAIN_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _declared_tokenizer_class(path: Path) -> str | None:
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    return cls if isinstance(cls, str) else None


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local directory.

    A plain `tokenizer.json` tokenizer (ours) is loaded as exactly that. `AutoTokenizer` would instead
    pick the tokenizer class registered for the model type found in the directory's config.json, and
    for some types (qwen2 among them) that class rebuilds a byte-level BPE pipeline over our char- or
    word-level vocabulary, which silently breaks encoding.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer directory {path} does not exist")
    try:
        if _declared_tokenizer_class(path) in _PLAIN_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
            tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {type(err).__name__}: {err}") from err
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"tokenizer at {path} has neither a pad nor an eos token")
        log.warning("tokenizer at %s has no pad token; padding with eos %r", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: Path, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """A causal LM from a local directory, on `device`, in eval mode."""
    path = _require_model_dir(path, "model")
    td = torch_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=td, local_files_only=True)
    except Exception as err:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {type(err).__name__}: {err}") from err
    try:
        torch.nn.Module.to(model, device)  # in place
    except Exception as err:
        raise ModelLoadError(f"cannot move the model from {path} to device {device!r}: {err}") from err
    model.eval()
    return model  # type: ignore[no-any-return]


def require_model_dir(path: Path, what: str = "model") -> Path:
    """`path` if it is a transformers model directory, else a `ModelLoadError` naming it."""
    return _require_model_dir(path, what)
