"""Model and tokenizer loading from local directories only (never a hub id), with clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.models.errors import ModelLoadError
from services.models.io.vocab import check_vocab, tokenizer_id_bound

__all__ = ["DTYPES", "ModelLoadError", "check_tokenizer_fits", "check_vocab", "load_causal_lm", "load_tokenizer",
           "model_vocab_size", "require_model_dir", "tokenizer_id_bound", "torch_dtype"]

if TYPE_CHECKING:  # a type only: transformers.modeling_utils is ~2 s of imports that tokenizer-only services skip
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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


