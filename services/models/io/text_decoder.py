"""Token ids back to text with the `tokenizers` library alone: what a service that only reads
completions (the reward service with a reward function) needs, without transformers' ~1-2 s import.

The same text as transformers' `decode(ids, skip_special_tokens=True)` on a `tokenizer.json`
tokenizer: where `services.models.io.light_tokenizer` reproduces the whole tokenizer, its backend (the
special tokens exactly as transformers registers and adds them); otherwise (a model-specific
tokenizer class, whose decoder transformers still takes from tokenizer.json) the special tokens its
tokenizer_config.json and special_tokens_map.json name are registered as special. Tokenization
spaces are cleaned up as transformers does (when the config asks, never for a BPE model unless it
insists). A directory without a tokenizer.json gets None: load the transformers tokenizer there
(`services.models.io.loading.load_tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.models.io.light_tokenizer import LightTokenizer, Unsupported, clean_up_tokenization, cleans_up

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_names(config: dict[str, Any]) -> list[str]:
    out = []
    for value in [*(config.get(k) for k in _SPECIAL_KEYS), *config.get("additional_special_tokens", [])]:
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str):
            out.append(content)
    return out


class TextDecoder:
    """`decode` / `batch_decode` with skip_special_tokens=True, as the reward scorer calls them."""

    def __init__(self, backend: Any, clean_up: bool) -> None:
        self.backend = backend
        self.clean_up = clean_up

    @classmethod
    def load(cls, path: Path) -> TextDecoder | None:
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            tok = LightTokenizer.load(path)
            return cls(tok.backend, cleans_up(tok.backend, tok.clean_up_tokenization_spaces, tok.clean_up_bpe))
        except Unsupported:
            pass
        from tokenizers import AddedToken, Tokenizer

        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            f = path / name
            if f.is_file():
                config.update(json.loads(f.read_text()))
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        names = [n for n in _token_names(config) if backend.token_to_id(n) is not None]
        backend.add_special_tokens([AddedToken(n, special=True) for n in names])
        bpe_too = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        return cls(backend, cleans_up(backend, bool(config.get("clean_up_tokenization_spaces", False)), bpe_too))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return clean_up_tokenization(text) if self.clean_up else text

    def batch_decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(r, skip_special_tokens) for r in rows]
