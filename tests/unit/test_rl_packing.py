"""Packed rows (several sequences per row, `attention_mask=None`, positions restarting) give the log-probs
and values of the unpacked padded layout: transformers' mask keeps each sequence to itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from bench.rollouts import random_rollout
from services.models.io.loading import load_causal_lm
from services.models.nets.critic import ValueModel
from services.models.nets.logprobs import response_logprobs
from services.reference.scorer import ReferenceScorer
from services.rl.batch import Rollout
from services.rl.micro import pack_groups, real_lengths
from services.rl.packing import pack_rows, packed_logprobs, packed_values

VOCAB = 64


def _random(arch: str, attn: str) -> PreTrainedModel:
    torch.manual_seed(0)
    kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=VOCAB, attn_implementation=attn)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()


# Lengths 7, 3, 10, 1+1, 6, 4, 2, 9: a 10-wide row holds 7 + 3, another 6 + 4, ...
PLEN, RLEN = [3, 2, 4, 1, 5, 1, 2, 6], [4, 1, 6, 1, 1, 3, 0, 3]


def _bins(r: Rollout) -> list[list[int]]:
    plen, rlen = real_lengths(r)
    (rows, bins), = pack_groups(plen + rlen, budget=10 * len(r))  # one micro-batch of packed rows
    return [[rows[j] for j in b] for b in bins]


def test_pack_rows_restarts_positions_and_points_at_the_predicting_column() -> None:
    r = random_rollout([2, 1], [2, 3], VOCAB)
    rows = pack_rows(r, [[0, 1]])
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert rows.input_ids[0, :4].tolist() == [*r.prompt_ids[0].tolist(), *r.response_ids[0, :2].tolist()]
    assert rows.src_col.tolist() == [1, 2, 4, 5, 6] and rows.dst_col.tolist() == [0, 1, 0, 1, 2]
    assert rows.dst_row.tolist() == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_logprobs_equal_unpacked_on_random_models(arch: str, attn: str) -> None:
    model = _random(arch, attn)
    r = random_rollout(PLEN, RLEN, VOCAB)
    bins = _bins(r)
    assert any(len(b) > 1 for b in bins), bins
    with torch.no_grad():
        want, went = response_logprobs(model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask,
                                       temperature=0.7, with_entropy=True)
        got, gent = packed_logprobs(model, r, bins, temperature=0.7, with_entropy=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert gent is not None
    torch.testing.assert_close(gent, went, atol=1e-5, rtol=0)
    # The comparison can fail: the same rows with positions running on across a row (no packing seen)
    # let later sequences attend to earlier ones, which moves their log-probs well past the tolerance.
    rows = pack_rows(r, bins)

    def at_targets(**kw: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            lp = model(input_ids=rows.input_ids, use_cache=False, **kw).logits.log_softmax(-1)
        return lp[rows.src_row, rows.src_col].gather(-1, rows.targets[:, None]).squeeze(-1)

    assert float((at_targets() - at_targets(position_ids=rows.position_ids)).abs().max()) > 1e-3

def test_packed_values_equal_unpacked() -> None:
    torch.manual_seed(0)
    vm = ValueModel(_random("qwen2", "sdpa").model).eval()
    torch.nn.init.normal_(vm.value_head.weight)
    r = random_rollout(PLEN, RLEN, VOCAB)
    with torch.no_grad():
        want = vm.values(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
        got = packed_values(vm, r, _bins(r))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_tiny_model_scores_the_same_packed_budgeted_or_whole(tiny_model: Path) -> None:
    model = load_causal_lm(tiny_model)
    vocab = int(model.config.vocab_size)
    r = random_rollout(PLEN, RLEN, vocab, seed=3)
    whole = ReferenceScorer(model, 0.9).score(r)
    budget = ReferenceScorer(model, 0.9, micro_tokens=12).score(r)
    packed = ReferenceScorer(model, 0.9, micro_tokens=20, pack=True).score(r)
    assert whole.shape == budget.shape == packed.shape == r.response_ids.shape
    assert bool((whole[~r.response_mask] == 0).all()) and bool((whole[r.response_mask] < 0).all())
    torch.testing.assert_close(budget, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, whole, atol=1e-5, rtol=0)
