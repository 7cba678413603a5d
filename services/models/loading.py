"""Model and tokenizer loading from local directories only (never a hub id), with clear errors."""

from __future__ import annotations

import json
import logging
import time
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
from services.models.atomic import MARKER, is_complete, staging_dir
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
    if spec.gguf_file is not None:
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
    if (path / "config.json").is_file():
        check_tokenizer_fits(tok, path)
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


# -- fit between tokenizer and model -------------------------------------------------------------


def tokenizer_id_bound(tokenizer: PreTrainedTokenizerBase) -> int:
    """One past the largest id the tokenizer can produce (added tokens included)."""
    ids = tokenizer.get_vocab().values()
    return max(len(tokenizer), max(ids, default=-1) + 1)


def model_vocab_size(path: Path) -> int:
    """The embedding rows of the causal LM at `path`, from its config.json (no weights are read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        size = config.get_text_config().vocab_size
    except Exception as err:
        raise ModelLoadError(f"cannot read the model config in {path}: {type(err).__name__}: {err}") from err
    if not isinstance(size, int) or size <= 0:
        raise ModelLoadError(f"the model config in {path} has no usable vocab_size (got {size!r})")
    return size


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    """A `ModelLoadError` naming both sizes when the tokenizer can emit ids the model has no embedding
    for: such an id fails deep inside the first forward pass (or, on a GPU, corrupts memory)."""
    check_vocab(tokenizer, model_vocab_size(model_dir), str(model_dir))


def check_vocab(tokenizer: PreTrainedTokenizerBase, vocab: int, where: str) -> None:
    bound = tokenizer_id_bound(tokenizer)
    if bound > vocab:
        raise ModelLoadError(
            f"tokenizer and model in {where} do not fit: the tokenizer has {bound} token ids but the model's"
            f" vocabulary has {vocab} (ids >= {vocab} have no embedding); use the tokenizer the model was trained"
            " with, or resize the model's embeddings"
        )


# -- GGUF files ----------------------------------------------------------------------------------

GGUF_KIND = "gguf"


def _gguf_source(gguf: Path) -> dict[str, Any]:
    gguf = Path(gguf)
    if not gguf.is_file():
        state = "is not a file" if gguf.exists() else "does not exist"
        raise ModelLoadError(f"GGUF file {gguf} {state}")
    # Path and size identify the file well enough to refuse a copy of another one; hashing a
    # multi-gigabyte file at every start-up would cost more than the check is worth.
    return {"kind": GGUF_KIND, "source": str(gguf.resolve()), "bytes": gguf.stat().st_size}


def load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from one GGUF file, dequantized to float32 (trainable, saveable).

    Slow (about a minute for 135M parameters on two cores): see `materialize_gguf`."""
    from transformers import GgufConfig

    gguf = Path(gguf)
    _gguf_source(gguf)
    try:
        import gguf as _gguf_lib  # noqa: F401  (transformers needs it and says so only deep in a traceback)
    except ImportError:
        raise ModelLoadError(f"loading {gguf} needs the 'gguf' package: pip install gguf") from None
    folder = str(gguf.parent)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf.name, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True), dtype=torch.float32,
        )
    except Exception as err:
        raise ModelLoadError(f"cannot load a causal LM from the GGUF file {gguf}: {type(err).__name__}: {err}") from err
    not_float = sorted({str(p.dtype) for p in model.parameters() if not p.is_floating_point()})
    if not_float:
        raise ModelLoadError(f"{gguf} loaded with non-float parameters ({', '.join(not_float)}): not trainable")
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return model, tok


def materialize_gguf(gguf: Path, out_dir: Path, role: str = "policy") -> Path:
    """Dequantize `gguf` once into the `save_pretrained` directory `out_dir` (weights, config,
    tokenizer and chat template); returns `out_dir`. An existing copy of the same file is reused, so
    every service of a run loads the fast copy; a directory holding anything else is an error."""
    out_dir = Path(out_dir)
    want = _gguf_source(gguf)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        info = read_model_info(out_dir) if out_dir.is_dir() else None
        if info is None or info.get("kind") != GGUF_KIND:
            raise ModelLoadError(f"models.{role}: {out_dir} already holds something other than a copy of {gguf};"
                                 f" point models.{role}.path at an empty or new directory")
        if info.get("source") != want["source"] or info.get("bytes") != want["bytes"]:
            raise ModelLoadError(f"models.{role}: {out_dir} holds a copy of {info.get('source')}, not of {gguf};"
                                 f" delete it to convert again, or point models.{role}.path elsewhere")
        log.info("GGUF copy of %s already at %s", gguf, out_dir)
        return out_dir
    t0 = time.monotonic()
    log.info("dequantizing %s into %s (once per run directory)", gguf, out_dir)
    model, tok = load_gguf(gguf)
    check_vocab(tok, int(model.get_input_embeddings().weight.shape[0]), str(gguf))  # type: ignore[index]
    with staging_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        info = {**want, "role": role, "build_seconds": round(time.monotonic() - t0, 3)}
        (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
    if not is_complete(out_dir):
        raise ModelLoadError(f"models.{role}: {out_dir} was not written")
    log.info("dequantized %s into %s in %.1fs", gguf, out_dir, time.monotonic() - t0)
    return out_dir

