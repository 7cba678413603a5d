"""A tiny Qwen2 and a small ragged rollout for trainer tests that need real forward passes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.rl.batch import Rollout

VOCAB = 64


def tiny_qwen(layers: int = 2) -> Qwen2ForCausalLM:
    """The same random weights on every call (seed 0), in eval mode."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=VOCAB, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def ragged_rollout(versions: list[int], b: int = 6, p: int = 3, r: int = 5, with_ref: bool = True) -> Rollout:
    """Seeded rows of ragged responses, one left-padded prompt, groups of two, behaviour and reference
    log-probs drawn at random (the trainer scores the tokens itself where it matters)."""
    g = torch.Generator().manual_seed(1)
    resp_mask = torch.ones(b, r, dtype=torch.bool)
    for i in range(b):
        resp_mask[i, 1 + (i * 2) % r:] = False
    prompt_mask = torch.ones(b, p, dtype=torch.bool)
    prompt_mask[0, 0] = False
    prompt_ids = torch.randint(1, VOCAB, (b, p), generator=g)
    response_ids = torch.randint(1, VOCAB, (b, r), generator=g)
    behaviour = -torch.rand(b, r, generator=g) * 3 - 1
    advantages = torch.randn(b, r, generator=g)
    ref = -torch.rand(b, r, generator=g) * 3 - 1
    return Rollout(
        task_ids=[f"t{i}" for i in range(b)], prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        response_ids=response_ids, response_mask=resp_mask, behaviour_logprobs=behaviour,
        group_ids=torch.arange(b) // 2, versions=torch.tensor(versions), version=max(versions),
        advantages=advantages, ref_logprobs=ref if with_ref else None,
    )


T = TypeVar("T")


def with_statistics_read_once(monkeypatch: pytest.MonkeyPatch,
                              step: Callable[[], T]) -> tuple[T, list[dict[str, float]]]:
    """Run a train step where no tensor may be read back one value at a time (`item`, `float`): what
    it returns and each `DeviceSums.read` it made (a read of a GPU value waits for the GPU)."""
    from services.rl import trainer as trainer_mod

    reads: list[dict[str, float]] = []
    read = trainer_mod.DeviceSums.read

    def counted(self: trainer_mod.DeviceSums) -> dict[str, float]:
        reads.append(read(self))
        return reads[-1]

    def refuse(self: torch.Tensor, *a: object) -> float:
        raise AssertionError("a tensor read back one value at a time during a train step")

    with monkeypatch.context() as m:
        m.setattr(trainer_mod.DeviceSums, "read", counted)
        m.setattr(torch.Tensor, "item", refuse)
        m.setattr(torch.Tensor, "__float__", refuse)
        out = step()
    return out, reads
