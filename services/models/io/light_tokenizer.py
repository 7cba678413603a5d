"""A tokenizer built on the `tokenizers` library and jinja2 alone: what a service that encodes
prompts and decodes completions but runs no model (the controller) needs, without transformers'
import (one to several seconds on a small host, at every start).

It reproduces transformers' (5.x) own tokenizer for a `tokenizer.json` directory whose
tokenizer_config.json names a plain tokenizers-backed class (`TokenizersBackend`,
`PreTrainedTokenizerFast`: what rlfleet's tiny models and a GGUF model's converted tokenizer save):
the same special tokens (named ones from the config and, in its legacy form, special_tokens_map.json,
added to the vocabulary when missing, as transformers adds them), the same ids for
`tokenizer(text, add_special_tokens=...)`, the same `decode` / `batch_decode` (clean-up of
tokenization spaces as transformers applies it), and the same chat-template rendering
(`apply_chat_template`: transformers' sandboxed jinja2 environment, its globals and filters, its
normalisation of the messages). tests/unit/test_light_tokenizer.py pins all of it against
transformers on the tiny models and on SmolLM2-135M-Instruct. A GGUF policy's tokenizer is
converted from the GGUF file by transformers once, where the model is dequantized (the launcher's
`materialize_gguf`), and saved as such a directory: no service converts it again, and the
controller reads the saved directory here.

Anything else (no tokenizer.json, a model-specific tokenizer class, which transformers rebuilds from
the vocabulary with its own pipeline, legacy added_tokens.json files, the Mistral regex fix) is
`Unsupported`: `load_tokenizer` then loads transformers' tokenizer, lazily.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.models.errors import ModelLoadError
from services.models.io.chat_template import render
from services.models.io.vocab import check_vocab, config_vocab_size

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer

log = logging.getLogger(__name__)

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (the order missing tokens get their ids in).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Classes transformers loads as exactly what tokenizer.json says (PreTrainedTokenizerFast is an alias).
PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


class Unsupported(Exception):
    """A tokenizer directory this module does not reproduce exactly; the message says why."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise Unsupported(f"{path.name} is not a JSON object")
    return data


def _convert_added_tokens(obj: Any) -> Any:
    """transformers' `convert_added_tokens(obj, save=False)`: serialized AddedTokens to AddedTokens."""
    from tokenizers import AddedToken

    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in obj.items() if k != "__type"})
    if isinstance(obj, list | tuple):
        return [_convert_added_tokens(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _convert_added_tokens(v) for k, v in obj.items()}
    return obj


def _init_kwargs(path: Path) -> dict[str, Any]:
    """What transformers' `_from_pretrained` hands the tokenizer class, for a plain tokenizer.json
    directory: tokenizer_config.json, the chat templates, the special tokens."""
    from tokenizers import AddedToken

    config = _read_json(path / "tokenizer_config.json")
    cls = config.pop("tokenizer_class", None)
    if cls not in PLAIN_CLASSES:
        raise Unsupported(f"tokenizer_class {cls!r}: transformers builds that class's own pipeline, not"
                          " tokenizer.json's")
    for key in ("fast_tokenizer_files", "init_inputs", "auto_map"):
        if config.get(key):
            raise Unsupported(f"tokenizer_config.json sets {key}")
    if config.get("fix_mistral_regex"):
        raise Unsupported("tokenizer_config.json asks for the Mistral regex fix")
    if (path / "added_tokens.json").is_file() and "added_tokens_decoder" not in config:
        raise Unsupported("a legacy added_tokens.json")
    init = config
    init.pop("add_bos_token", None)  # dropped by transformers when tokenizer.json exists
    init.pop("add_eos_token", None)

    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in extra_dir.glob("*.jinja"):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        init["chat_template"] = templates["default"]
    elif templates:
        init["chat_template"] = templates

    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    explicit = {k: init.pop(k) for k in list(init)
                if k not in SPECIAL_TOKEN_NAMES and k.endswith("_token") and isinstance(init[k], str)}
    if isinstance(init.get("extra_special_tokens"), dict):
        explicit.update(init.pop("extra_special_tokens"))

    added: dict[int, AddedToken] = {}
    by_content: dict[str, AddedToken] = {}
    if "added_tokens_decoder" in init:
        for idx, tok in init["added_tokens_decoder"].items():
            tok = AddedToken(**tok) if isinstance(tok, dict) else tok
            if not isinstance(tok, AddedToken):
                raise Unsupported(f"added_tokens_decoder[{idx}] is a {type(tok).__name__}")
            added[int(idx)], by_content[str(tok)] = tok, tok
    else:
        for key, value in _read_json(path / "special_tokens_map.json").items():  # legacy: merged into the config
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                existing = list(init.get("extra_special_tokens") or [])
                for tok in value:
                    tok = AddedToken(**tok, special=True) if isinstance(tok, dict) else tok
                    if tok not in existing:
                        existing.append(tok)
                value = existing
            elif isinstance(value, list) and any(not isinstance(v, str) for v in value):
                raise Unsupported(f"special_tokens_map.json {key!r} holds serialized tokens")
            init[key] = value
        if isinstance(init.get("extra_special_tokens"), dict):
            explicit.update(init.pop("extra_special_tokens"))
        for entry in json.loads((path / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", []):
            entry = dict(entry)
            tok = AddedToken(**{k: v for k, v in entry.items() if k != "id"})
            added[int(entry["id"])], by_content[str(tok)] = tok, tok
    init["added_tokens_decoder"] = added
    init = _convert_added_tokens(init)
    for key in SPECIAL_TOKEN_NAMES:
        if key in init and by_content and init[key] is not None:
            init[key] = by_content.get(str(init[key]), init[key])
    if explicit:
        init["model_specific_special_tokens"] = explicit
    return init


class LightTokenizer:
    """The parts of a transformers tokenizer rlfleet uses: special tokens and their ids, `__call__`
    / `encode`, `decode` / `batch_decode`, `apply_chat_template`, `get_vocab`, `len`."""

    def __init__(self, backend: Tokenizer, special: dict[str, Any], chat_template: str | dict[str, str] | None,
                 clean_up: bool, clean_up_bpe: bool, name_or_path: str = "") -> None:
        self.backend = backend
        self._special = special  # name -> str or AddedToken (None: unset)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up
        self.clean_up_bpe = clean_up_bpe  # clean up even for a BPE model
        self.name_or_path = name_or_path

    @classmethod
    def load(cls, path: Path) -> LightTokenizer:
        """The tokenizer of directory `path`; `Unsupported` where it would not be transformers' (see
        the module docstring)."""
        from tokenizers import AddedToken, Tokenizer, processors

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise Unsupported("no tokenizer.json")
        init = _init_kwargs(path)
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        # transformers encodes without the truncation and padding tokenizer.json may carry.
        backend.no_truncation()
        backend.no_padding()

        # PreTrainedTokenizerBase.__init__: named, extra and model-specific special tokens.
        if "additional_special_tokens" in init and "extra_special_tokens" not in init:
            init["extra_special_tokens"] = init.pop("additional_special_tokens")
        special: dict[str, Any] = dict.fromkeys(SPECIAL_TOKEN_NAMES)
        extra: list[Any] = []
        explicit = dict(init.pop("model_specific_special_tokens", None) or {})
        auto: dict[str, Any] = {}
        for key in list(init):
            value = init[key]
            if key in SPECIAL_TOKEN_NAMES:
                if value is None:
                    continue
                if not isinstance(value, str | AddedToken):
                    raise Unsupported(f"{key} is a {type(value).__name__}")
                special[key] = value
            elif key == "extra_special_tokens":
                if isinstance(value, dict):
                    explicit.update(value)
                elif isinstance(value, list | tuple):
                    extra = list(value)
            elif key.endswith("_token") and isinstance(value, str | AddedToken):
                auto[key] = value
        for key, value in {**auto, **explicit}.items():
            if not isinstance(value, str | AddedToken):
                raise Unsupported(f"{key} is a {type(value).__name__}")
            special[key] = value
        backend.encode_special_tokens = bool(init.get("split_special_tokens", False))

        # TokenizersBackend.__init__: add the special tokens the backend lacks, as transformers does.
        have = {repr(t) for t in backend.get_added_tokens_decoder().values()}
        to_add = [t for _, t in sorted(init["added_tokens_decoder"].items(), key=lambda x: x[0]) if repr(t) not in have]
        encoder = [t.content for _, t in sorted(backend.get_added_tokens_decoder().items(), key=lambda x: x[0])]
        encoder += [str(t) for t in to_add]
        for value in [*special.values(), *extra]:
            if value is not None and str(value) not in encoder and value not in to_add:
                to_add.append(value)
        if to_add:
            named = [str(t) for t in special.values() if t]
            tokens = []
            for token in to_add:
                if isinstance(token, str):
                    token = AddedToken(token, special=True)
                elif isinstance(token, AddedToken) and not token.special and str(token) in named:
                    token.special = True
                tokens.append(token)
            backend.add_tokens(tokens)
        if backend.post_processor is None:  # update_post_processor() without add_bos/add_eos
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

        template = init.get("chat_template")
        if isinstance(template, list | tuple):
            template = {t["name"]: t["template"] for t in template}
        tok = cls(backend, special, template, bool(init.get("clean_up_tokenization_spaces", False)),
                  bool(init.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
                  str(path))
        if tok.pad_token is None:  # as services.models.io.loading.load_tokenizer does
            if tok.eos_token is None:
                raise Unsupported("neither a pad nor an eos token")
            log.warning("tokenizer at %s has no pad token; padding with eos %r", path, tok.eos_token)
            tok._special["pad_token"] = tok._special["eos_token"]
        return tok

    # -- special tokens --------------------------------------------------------------------------------
    def _token(self, name: str) -> str | None:
        v = self._special.get(name)
        return None if v is None else str(v)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Each named (and model-specific) special token that is set, as text (what templates see)."""
        return {k: str(v) for k, v in self._special.items() if v is not None}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        index = self.backend.token_to_id(token)
        if index is None:
            unk = self._token("unk_token")
            return None if unk is None else self.backend.token_to_id(unk)
        return int(index)

    def _id(self, name: str) -> int | None:
        token = self._token(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))

    # -- vocabulary, encoding, decoding ----------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """{"input_ids": ..., "attention_mask": ...} of one text (lists) or of several (lists of lists)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        rows = [list(e.ids) for e in self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        clean = (self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None
                 else clean_up_tokenization_spaces)
        return clean_up_tokenization(text) if cleans_up(self.backend, clean, self.clean_up_bpe) else text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    # -- chat templates --------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list[Any] | None = None) -> str:
        """transformers' choice of template: a named one, the tool-use one, the default one."""
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Available"
                                 f" template names are {sorted(templates)}.")
            return chat_template
        if chat_template is None:
            if self.chat_template is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
            return self.chat_template
        return chat_template

    def apply_chat_template(self, conversation: Any, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs: Any) -> Any:
        """transformers' `apply_chat_template` for plain conversations: the rendered text
        (`tokenize=False`), or its ids (add_special_tokens=False), as a dict by default as in transformers 5."""
        if continue_final_message:
            raise NotImplementedError("continue_final_message: use transformers' tokenizer")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise NotImplementedError("tools as functions: pass JSON schemas")
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, list | tuple) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, list | tuple) and (
            isinstance(conversation[0], list | tuple) or hasattr(conversation[0], "messages"))
        conversations = conversation if batched else [conversation]
        extras = {**self.special_tokens_map, **kwargs}  # the caller's win over the special tokens
        rendered = [render(template, chat, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **extras) for chat in conversations]
        if not tokenize:
            return rendered if batched else rendered[0]
        ids = [self.encode(text, add_special_tokens=False) for text in rendered]
        out: Any = ids if batched else ids[0]
        if return_dict:
            mask = [[1] * len(i) for i in ids]
            return {"input_ids": out, "attention_mask": mask if batched else mask[0]}
        return out


def cleans_up(backend: Tokenizer, asked: bool, bpe_too: bool) -> bool:
    """Whether transformers' decode cleans up tokenization spaces: when asked, except for a BPE model
    (it would strip real spaces before punctuation) unless the config insists."""
    return asked and (type(backend.model).__name__ != "BPE" or bpe_too)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


# -- loading -----------------------------------------------------------------------------------------------


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of a model directory as `services.models.io.loading.load_tokenizer` gives it (pad
    set to eos where missing; an error when the tokenizer does not fit the model), without
    transformers where this module reproduces it, else transformers' own (imported only then)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer directory {path} does not exist")
    try:
        tok = LightTokenizer.load(path)
    except Unsupported as why:
        log.info("tokenizer at %s loads through transformers: %s", path, why)
        from services.models.io.loading import load_tokenizer as load_transformers_tokenizer

        return load_transformers_tokenizer(path)
    except Exception as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {type(err).__name__}: {err}") from err
    if (path / "config.json").is_file():
        vocab = config_vocab_size(path)
        if vocab is None:
            from services.models.io.loading import model_vocab_size

            vocab = model_vocab_size(path)
        check_vocab(tok, vocab, str(path))
    return tok

