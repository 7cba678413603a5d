"""Stand-in for your own model: writes a small untrained Qwen2 causal LM and a character-level
tokenizer for this data to a directory with `save_pretrained` (any local Hugging Face causal-LM
directory works the same way: point models.policy.path at it).

    python examples/byo/make_model.py runs/byo-model
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.models.roles.tokenizer import build_tokenizer_from_vocab


def make_model(out: Path) -> Path:
    tok = build_tokenizer_from_vocab(list("0123456789+="), "char")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(make_model(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/byo-model")))
