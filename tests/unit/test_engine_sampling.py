"""Engine pieces below the contract: sampling filters, parameter validation, the rollout packing, the factory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from services.models.engine import (
    Completion,
    EngineError,
    EngineUnavailable,
    SamplingParams,
    WeightSyncError,
    completions_to_rollout,
)
from services.models.engines.factory import available_engines, make_engine
from services.models.engines.hf_engine import load_strict, sample_next

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.0, 0.0, 3.0, 0.1, 0.2]])


def _draws(params: SamplingParams, n: int = 400) -> set[int]:
    g = torch.Generator().manual_seed(0)
    seen: set[int] = set()
    for _ in range(n):
        tok, _ = sample_next(LOGITS[:1], params, g)
        seen.add(int(tok))
    return seen


def test_top_k_limits_draws_to_the_k_most_likely_tokens() -> None:
    assert _draws(SamplingParams(top_k=2)) == {0, 1}
    assert _draws(SamplingParams(top_k=1)) == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.softmax(LOGITS[0], -1)  # ~[0.61, 0.22, 0.14, 0.03, 0.004]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert _draws(SamplingParams(top_p=0.7)) == {0, 1}
    assert _draws(SamplingParams(top_p=0.01)) == {0}


def test_reported_logprob_is_the_unfiltered_tempered_log_softmax() -> None:
    params = SamplingParams(temperature=0.5, top_k=1)
    tok, lp = sample_next(LOGITS, params, torch.Generator().manual_seed(0))
    assert tok.tolist() == [0, 2]
    expected = torch.log_softmax(LOGITS / 0.5, -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expected)
    assert torch.all(lp < 0)  # not the renormalised top-1 probability (which would be log 1 = 0)


def test_greedy_picks_the_argmax_and_reports_untempered_logprobs() -> None:
    tok, lp = sample_next(LOGITS, SamplingParams(temperature=0.0), torch.Generator())
    assert tok.tolist() == [0, 2]
    torch.testing.assert_close(lp, torch.log_softmax(LOGITS, -1).gather(-1, tok[:, None]).squeeze(-1))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"top_k": -1}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop_token_ids": (-2,)}, "stop_token")],
)
def test_invalid_sampling_params_are_rejected_by_name(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_completions_pack_into_the_rollout_layout() -> None:
    prompts = [[5, 6, 7], [8]]
    comps = [Completion([9, 2], [-0.5, -0.25], "stop"), Completion([4, 4, 4], [-1.0, -2.0, -3.0], "length")]
    r = completions_to_rollout(["t0", "t1"], prompts, comps, [0, 0], version=4, pad_id=0)
    assert r.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert r.prompt_mask.tolist() == [[True, True, True], [False, False, True]]
    assert r.response_ids.tolist() == [[9, 2, 0], [4, 4, 4]]
    assert r.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert r.behaviour_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert r.group_ids.tolist() == [0, 0] and r.version == 4 and r.task_ids == ["t0", "t1"]


def test_an_all_aborted_batch_packs_to_zero_response_columns() -> None:
    r = completions_to_rollout(["t"], [[1, 2]], [Completion([], [], "abort")], [3], version=0, pad_id=0)
    assert r.response_ids.shape == (1, 0) and r.behaviour_logprobs.shape == (1, 0)


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="lengths disagree"):
        completions_to_rollout(["a", "b"], [[1]], [Completion([], [], "stop")], [0], 0, 0)
    with pytest.raises(ValueError, match="log-probs"):
        Completion([1, 2], [0.0], "stop")


def test_unknown_engine_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="unknown generation engine 'sglang'; known: transformers, vllm"):
        make_engine("sglang", tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_the_package_names_the_missing_package(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable, match="needs the 'vllm' package"):
        make_engine("vllm", tmp_path)
    assert available_engines()["transformers"] is None
    assert "vllm" in (available_engines()["vllm"] or "")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(3))


def test_strict_load_counts_a_tied_alias_once_and_copies_in_place() -> None:
    m = _Tied()
    weight = m.embed.weight
    load_strict(m, {"head.weight": torch.full((4, 3), 2.0), "scale": torch.zeros(3)})
    assert m.embed.weight is weight and torch.all(m.embed.weight == 2.0) and torch.all(m.get_buffer("scale") == 0)


def test_strict_load_names_every_problem_and_changes_nothing() -> None:
    m = _Tied()
    before = m.embed.weight.detach().clone()
    with pytest.raises(WeightSyncError) as err:
        load_strict(m, {"embed.weight": torch.zeros(5, 3), "bogus": torch.zeros(1)})
    msg = str(err.value)
    assert "unknown names: bogus" in msg and "missing names: scale" in msg
    assert "embed.weight (got (5, 3), expected (4, 3))" in msg
    assert torch.equal(m.embed.weight, before)
