"""How many token ids a tokenizer can produce against how many embedding rows a model has, checked
without transformers (for the services that import none: the controller's tokenizer; the others
check through `services.models.io.loading`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.models.errors import ModelLoadError

# Sub-configs transformers' get_text_config() would read the vocabulary size from.
_TEXT_CONFIG_KEYS = ("text_encoder", "decoder", "generator", "text_config")


def tokenizer_id_bound(tokenizer: Any) -> int:
    """One past the largest id the tokenizer can produce (added tokens included)."""
    ids = tokenizer.get_vocab().values()
    return max(len(tokenizer), max(ids, default=-1) + 1)


def check_vocab(tokenizer: Any, vocab: int, where: str) -> None:
    """A `ModelLoadError` naming both sizes when the tokenizer can emit ids the model has no embedding
    for: such an id fails deep inside the first forward pass (or, on a GPU, corrupts memory)."""
    bound = tokenizer_id_bound(tokenizer)
    if bound > vocab:
        raise ModelLoadError(
            f"tokenizer and model in {where} do not fit: the tokenizer has {bound} token ids but the model's"
            f" vocabulary has {vocab} (ids >= {vocab} have no embedding); use the tokenizer the model was trained"
            " with, or resize the model's embeddings"
        )


def config_vocab_size(model_dir: Path) -> int | None:
    """The embedding rows from config.json as transformers' get_text_config() reads them; None where
    that needs transformers (a composite config, or no vocab_size written)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or any(config.get(k) is not None for k in _TEXT_CONFIG_KEYS):
        return None
    size = config.get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
