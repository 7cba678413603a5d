"""Tokenizers for tiny task models, built offline with the `tokenizers` library.

Ids 0..3 are `<pad>`, `<s>`, `</s>`, `<unk>`; the task's vocabulary follows in the task's order.
Encoding adds no special tokens (no BOS), so `tokenizer(text)` gives the same ids with or without
`add_special_tokens`, and every service that encodes a prompt agrees with the warm-up. Char-level
tokenizers decode by concatenation, word-level ones by joining with spaces. The result is a
`PreTrainedTokenizerFast` with pad/bos/eos/unk set and left padding, so `save_pretrained` +
`AutoTokenizer.from_pretrained(dir)` round-trip without a hub.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.tasks.base import Task, TokenizerKind

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)


def build_tokenizer_from_vocab(vocab: Sequence[str], kind: TokenizerKind) -> PreTrainedTokenizerFast:
    tokens: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for tok in vocab:
        if kind == "char" and len(tok) != 1:
            raise ValueError(f"char-level vocabulary entries must be single characters, got {tok!r}")
        if kind == "word" and (not tok or any(c.isspace() for c in tok)):
            raise ValueError(f"word-level vocabulary entries must be non-empty and space-free, got {tok!r}")
        tokens.setdefault(tok, len(tokens))
    tk = Tokenizer(models.WordLevel(tokens, unk_token=UNK))
    if kind == "char":
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tk.decoder = decoders.Fuse()
    elif kind == "word":
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; allowed: 'char', 'word'")
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )


def build_tokenizer(task: Task) -> PreTrainedTokenizerFast:
    """The tokenizer of a tiny model for `task` (char- or word-level over `task.vocab()`)."""
    return build_tokenizer_from_vocab(task.vocab(), task.tokenizer_kind)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Prompt token ids as the policy saw them in warm-up (our tokenizers add no special tokens)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_completion(tokenizer: PreTrainedTokenizerBase, text: str, add_eos: bool = True) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token")
        ids.append(int(tokenizer.eos_token_id))
    return ids


def decode_completion(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Completion text for the reward: special tokens (EOS, padding) dropped."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))
