"""The vLLM backend: what runs everywhere (the start-up error, seeds, strict-sync bookkeeping, log-prob
extraction) and, where vLLM and a CUDA GPU are there, checks on a live engine beyond the shared
contract (tests/unit/test_engine_contract.py runs the contract against this backend too).

The live tests start one small engine per module; on a GPU shared with other engines set
RLFLEET_VLLM_GPU_MEMORY_UTILIZATION (e.g. 0.05) and RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.core.config.run import TinyModelSpec
from services.models.engine import (
    EngineError,
    EngineUnavailable,
    SamplingParams,
    WeightSyncError,
    completions_to_rollout,
)
from services.models.engines.factory import available_engines, make_engine
from services.models.engines.vllm_adapter import sampled_logprobs
from services.models.engines.vllm_engine import expected_parameters, vllm_seed
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import response_logprobs
from services.models.roles.tiny import build_tiny_model
from services.tasks import make_task

REASON = available_engines()["vllm"]
live = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SPEC = TinyModelSpec(warmup_steps=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    task = make_task("sentiment")
    root = tmp_path_factory.mktemp("vllm")
    return {name: build_tiny_model(task, SPEC, root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}


# -- everywhere ------------------------------------------------------------------------------------
@pytest.mark.skipif(REASON is None, reason="vLLM runs here")
def test_make_engine_says_why_vllm_cannot_run(models: dict[str, Path]) -> None:
    assert REASON is not None and "vllm" in REASON.lower()
    with pytest.raises(EngineUnavailable, match="vllm"):
        make_engine("vllm", models["a"])


def test_transformers_backend_refuses_vllm_options(models: dict[str, Path]) -> None:
    with pytest.raises(EngineError, match="takes no options; got gpu_memory_utilization"):
        make_engine("transformers", models["a"], gpu_memory_utilization=0.3)


def test_request_seeds_differ_per_row_and_per_call_seed() -> None:
    rows = [vllm_seed(SamplingParams(seed=7), i) for i in range(1024)]
    assert len(set(rows)) == len(rows)
    assert rows == [vllm_seed(SamplingParams(seed=7), i) for i in range(1024)]
    assert vllm_seed(SamplingParams(seed=8), 0) not in rows[:8]
    assert all(0 <= s < 2**31 for s in rows)
    # a replica's slice and a call that names each row's seed sample as the whole call did
    assert [vllm_seed(SamplingParams(seed=7).rows(512, 1024), i) for i in range(512)] == rows[512:]
    joined = SamplingParams(row_seeds=SamplingParams(seed=7).seeds(1024))
    assert [vllm_seed(joined, i) for i in range(1024)] == rows


def test_expected_parameters_group_tied_embeddings(models: dict[str, Path]) -> None:
    shapes, groups = expected_parameters(models["a"])
    sd = load_causal_lm(models["a"]).state_dict()
    assert shapes == {n: tuple(t.shape) for n, t in sd.items()}
    assert ["model.embed_tokens.weight", "lm_head.weight"] in groups
    assert sum(len(g) for g in groups) == len(shapes)


def test_sampled_logprobs_reads_flat_and_dict_layouts() -> None:
    flat = SimpleNamespace(start_indices=[0, 0, 2], end_indices=[0, 2, 3], token_ids=[5, 9, 4],
                           logprobs=[-0.5, -3.0, -1.25])
    assert sampled_logprobs(flat, [1, 9, 4], skip_first=True) == [-3.0, -1.25]
    dicts: list[Any] = [{7: SimpleNamespace(logprob=-0.1)}, {8: SimpleNamespace(logprob=-2.0)}]
    assert sampled_logprobs(dicts, [7, 8]) == [-0.1, -2.0]
    with pytest.raises(EngineError, match="miss token 3"):
        sampled_logprobs(dicts, [7, 3])


# -- on a GPU with vLLM ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> Iterator[Any]:
    if REASON is not None:
        pytest.skip(REASON)
    e: Any = make_engine("vllm", models["a"], enforce_eager=True)
    yield e
    e.close()


def _trainer_logprobs(path: Path, prompts: list[list[int]], comps: list[Any], temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    tok = load_tokenizer(path)
    r = completions_to_rollout([str(i) for i in range(len(prompts))], prompts, comps, list(range(len(prompts))),
                               0, tok.pad_token_id)
    with torch.no_grad():
        lp = response_logprobs(load_causal_lm(path), r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask,
                               temperature=temperature)
    return r.behaviour_logprobs[r.response_mask], lp[r.response_mask]


def _long_prompts(models: dict[str, Path], n: int = 8, length: int = 40) -> list[list[int]]:
    task, tok = make_task("sentiment"), load_tokenizer(models["a"])
    out = []
    for i in range(n):
        ids = list(tok(task.prompt(i).text, add_special_tokens=False)["input_ids"])
        out.append((ids * length)[:length])  # > 2 full KV blocks of 16: the prefix cache holds them
    return out


@live
def test_vllm_logprobs_are_tempered_and_unfiltered(engine: Any, models: dict[str, Path]) -> None:
    """vLLM 0.26 has no logprobs_mode for log_softmax(logits/T) before top-k/top-p; the patched sampler
    gives exactly that, so the trainer's recomputation agrees under filtering and temperature."""
    assert engine.describe()["scoring"].startswith(("v1", "v2"))
    prompts = _long_prompts(models)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, max_new_tokens=16, seed=3)
    got, want = _trainer_logprobs(models["a"], prompts, engine.generate(prompts, params), 0.7)
    assert got.numel() > len(prompts)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@live
def test_vllm_update_resets_the_prefix_cache(engine: Any, models: dict[str, Path]) -> None:
    prompts = _long_prompts(models)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.generate(prompts, greedy)  # the prompts' KV blocks are now cached under weights a
    engine.update_weights(load_causal_lm(models["b"]).state_dict().items(), engine.version + 1)
    got, want = _trainer_logprobs(models["b"], prompts, engine.generate(prompts, greedy), 1.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert engine.last_sync["buckets"] >= 1


@live
def test_vllm_strict_sync_changes_nothing_on_error(engine: Any, models: dict[str, Path]) -> None:
    prompts = _long_prompts(models, n=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = [c.token_ids for c in engine.generate(prompts, greedy)]
    sd = dict(load_causal_lm(models["a"]).state_dict())
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightSyncError, match=r"shape mismatch: model\.layers\.0\.mlp\.up_proj\.weight"):
        engine.update_weights(sd.items(), engine.version + 1)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == before


@live
def test_vllm_score_matches_the_trainer(engine: Any, models: dict[str, Path]) -> None:
    seqs = _long_prompts(models, n=4, length=24)
    scores = engine.score(seqs)
    path = models["b"] if engine.version > 0 else models["a"]
    ids = torch.tensor(seqs)
    with torch.no_grad():
        logits = load_causal_lm(path)(input_ids=ids).logits.float()
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(scores), want, atol=1e-4, rtol=0)
