"""The generation-engine contract, run against every backend installed here.

The transformers backend always runs; vLLM runs only where it is importable (else skipped with the
reason). Each test builds its engine through `make_engine`, the way the actor does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.core.config.run import TinyModelSpec
from services.models.engine import (
    Completion,
    EngineError,
    GenerationEngine,
    SamplingParams,
    WeightSyncError,
    completions_to_rollout,
)
from services.models.engines.factory import available_engines, make_engine
from services.models.engines.proc import FORKSERVER_ENV
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import response_logprobs
from services.models.roles.tiny import build_tiny_model
from services.models.roles.tokenizer import encode_prompt
from services.tasks import make_task

BACKENDS = [
    pytest.param((name, False), id=name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))
    for name, reason in available_engines().items()
] + [pytest.param(("transformers", True), id="transformers-process")]  # the engine in a child process
# Random init over a 140-word vocabulary: EOS is rare, so sequences run long unless told to stop.
SPEC = TinyModelSpec(warmup_steps=0)
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def process_engines_fork_from_one_server() -> Iterator[None]:
    """This module's ~25 process engines fork from one preloaded forkserver (`engines.proc.start_context`)
    instead of each importing torch and transformers afresh: 342 s -> 120 s for them on 2 cores."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FORKSERVER_ENV, "1")
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    task = make_task("sentiment")
    root = tmp_path_factory.mktemp("engine")
    return {name: build_tiny_model(task, SPEC, root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> list[list[int]]:
    task, tok = make_task("sentiment"), load_tokenizer(models["a"])
    out = [encode_prompt(tok, task.prompt(i).text) for i in range(12)]
    return [p[: 1 + i % len(p)] for i, p in enumerate(out)]  # prompts of 1..3 tokens: real left padding


@pytest.fixture(params=BACKENDS)
def new_engine(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[Callable[..., GenerationEngine]]:
    name, process = request.param
    made: list[GenerationEngine] = []

    def make(which: str = "a", **kw: int) -> GenerationEngine:
        engine = make_engine(name, models[which], process=process, **kw)  # type: ignore[arg-type]
        made.append(engine)
        return engine

    yield make
    for engine in made:  # child processes hold a whole torch each: stop them with the test
        close = getattr(engine, "close", None)
        if process and callable(close):
            close()


def _rows(completions: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in completions]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, max_new_tokens=12, seed=1),
     SamplingParams(temperature=0.7, top_k=5, max_new_tokens=12, seed=2),
     SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=12, seed=3),
     SamplingParams(temperature=0.0, max_new_tokens=12)],
    ids=["t1", "t0.7-topk", "t1.3-topp", "greedy"],
)
def test_engine_logprobs_equal_trainer_logprobs_of_the_same_tokens(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]],
    params: SamplingParams,
) -> None:
    engine = new_engine()
    comps = engine.generate(prompts, params)
    tok = load_tokenizer(models["a"])
    r = completions_to_rollout([str(i) for i in range(len(prompts))], prompts, comps, list(range(len(prompts))),
                               engine.version, tok.pad_token_id)
    trainer_temperature = params.temperature or 1.0  # greedy reports log_softmax(logits)
    with torch.no_grad():
        lp = response_logprobs(load_causal_lm(models["a"]), r.prompt_ids, r.prompt_mask, r.response_ids,
                               r.response_mask, temperature=trainer_temperature)
    assert r.response_mask.sum() > len(prompts)  # something was generated
    torch.testing.assert_close(r.behaviour_logprobs[r.response_mask], lp[r.response_mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=10, seed=4),
                                    SamplingParams(temperature=0.0, max_new_tokens=10)], ids=["sampled", "greedy"])
def test_generation_without_logprobs_draws_the_same_tokens_and_reports_zeros(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]], params: SamplingParams,
) -> None:
    # generation.behaviour_logprobs "trainer": the engine skips the log-probs, never the sampling.
    engine = new_engine()
    scored, unscored = engine.generate(prompts, params), engine.generate(prompts, replace(params, logprobs=False))
    assert _rows(unscored) == _rows(scored) and sum(map(len, _rows(unscored))) > len(prompts)
    assert [c.finish_reason for c in unscored] == [c.finish_reason for c in scored]
    assert all(c.logprobs == [0.0] * len(c.token_ids) for c in unscored)
    assert any(lp < 0 for c in scored for lp in c.logprobs)


def test_seeded_generation_is_reproducible(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    first = new_engine().generate(prompts, params)
    again, other_engine = new_engine().generate(prompts, params), new_engine().generate(prompts, params)
    assert _rows(first) == _rows(again) == _rows(other_engine)
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    different = new_engine().generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=124))
    assert _rows(first) != _rows(different)


def test_seeded_generation_is_the_same_in_another_process(
    new_engine: Callable[..., GenerationEngine], request: pytest.FixtureRequest, models: dict[str, Path],
    prompts: list[list[int]],
) -> None:
    name = request.node.callspec.params["new_engine"][0]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    here = _rows(new_engine().generate(prompts, params))
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from services.models.engine import SamplingParams\n"
        "from services.models.engines.factory import make_engine\n"
        "name, path, prompts = json.loads(sys.argv[1])\n"
        "out = make_engine(name, Path(path)).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8,"
        " seed=7))\n"
        "print(json.dumps([c.token_ids for c in out]))\n"
    )
    res = subprocess.run([sys.executable, "-c", script, json.dumps([name, str(models["a"]), prompts])],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # same thread count as this process
    assert json.loads(res.stdout.strip().splitlines()[-1]) == here


def test_stop_tokens_end_sequences_with_the_stop_token_included(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    engine = new_engine()
    base = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=5))
    row = next(i for i, c in enumerate(base) if len(c.token_ids) >= 6)
    stop = base[row].token_ids[4]
    comps = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=5, stop_token_ids=(stop,)))
    cut = base[row].token_ids.index(stop) + 1
    assert comps[row].token_ids == base[row].token_ids[:cut]
    assert comps[row].finish_reason == "stop" and comps[row].token_ids[-1] == stop
    stops = {stop, *engine.eos_token_ids}
    for c in comps:
        assert not stops & set(c.token_ids[:-1])  # nothing runs past a stop token
        assert (c.finish_reason == "stop") == (bool(c.token_ids) and c.token_ids[-1] in stops)


def test_tokenizer_eos_is_always_a_stop_token(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]]
) -> None:
    engine = new_engine()
    eos = load_tokenizer(models["a"]).eos_token_id
    assert eos in engine.eos_token_ids
    comps = engine.generate(prompts * 4, SamplingParams(max_new_tokens=64, seed=11, stop_token_ids=()))
    ended = [c for c in comps if c.token_ids and c.token_ids[-1] == eos]
    assert ended, "expected some sequence to sample EOS within 64 tokens"
    assert all(c.finish_reason == "stop" for c in ended)
    assert all(eos not in c.token_ids[:-1] for c in comps)


def test_max_new_tokens_caps_completions_with_finish_reason_length(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    comps = new_engine().generate(prompts, SamplingParams(max_new_tokens=3, seed=0))
    assert all(len(c.token_ids) <= 3 and len(c.logprobs) == len(c.token_ids) for c in comps)
    assert {c.finish_reason for c in comps if len(c.token_ids) < 3} <= {"stop"}
    assert any(c.finish_reason == "length" for c in comps)
    assert all(c.finish_reason == "length" for c in comps if len(c.token_ids) == 3 and c.finish_reason != "stop")


def test_update_weights_changes_outputs_and_bumps_the_version(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine, target = new_engine("a"), new_engine("b")
    before, wanted = _rows(engine.generate(prompts, greedy)), _rows(target.generate(prompts, greedy))
    assert before != wanted and engine.version == 0
    engine.update_weights(load_causal_lm(models["b"]).state_dict().items(), version=3)
    assert engine.version == 3
    assert _rows(engine.generate(prompts, greedy)) == wanted


def test_a_bfloat16_engine_synced_from_a_float32_trainer_generates_as_the_same_weights_in_bfloat16(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]]
) -> None:
    # generation.dtype: fp32 master weights in the trainer, a bf16 engine; each sync casts.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine, target = new_engine("a", dtype="bfloat16"), new_engine("b", dtype="bfloat16")
    engine.update_weights(load_causal_lm(models["b"], dtype="float32").state_dict().items(), version=1)
    assert _rows(engine.generate(prompts, greedy)) == _rows(target.generate(prompts, greedy))


def test_update_weights_accepts_named_parameters_without_tied_aliases(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]]
) -> None:
    engine = new_engine("a")
    engine.update_weights(load_causal_lm(models["b"]).named_parameters(), version=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert _rows(engine.generate(prompts, greedy)) == _rows(new_engine("b").generate(prompts, greedy))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [(lambda sd: sd.__setitem__("model.norm.weight", torch.ones(3)), r"shape mismatch: model\.norm\.weight"),
     (lambda sd: sd.__setitem__("model.extra.weight", torch.ones(3)), r"unknown names: model\.extra\.weight"),
     (lambda sd: sd.pop("model.norm.weight"), r"missing names: model\.norm\.weight")],
    ids=["shape", "unknown", "missing"],
)
def test_update_weights_rejects_bad_tensors_by_name_and_changes_nothing(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]],
    mutate: Callable[[dict[str, torch.Tensor]], object], fragment: str,
) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine = new_engine("a")
    before = _rows(engine.generate(prompts, greedy))
    sd = dict(load_causal_lm(models["b"]).state_dict())
    mutate(sd)
    with pytest.raises(WeightSyncError, match=fragment):
        engine.update_weights(sd.items(), version=1)
    assert engine.version == 0
    assert _rows(engine.generate(prompts, greedy)) == before


def test_update_weights_never_goes_back_a_version(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path]
) -> None:
    engine = new_engine("a")
    sd = load_causal_lm(models["a"]).state_dict()
    engine.update_weights(sd.items(), version=5)
    with pytest.raises(WeightSyncError, match="version 4 is older than the engine's version 5"):
        engine.update_weights(sd.items(), version=4)
    assert engine.version == 5


def _in_thread(fn: Callable[[], list[Completion]]) -> tuple[threading.Thread, dict[str, list[Completion]]]:
    out: dict[str, list[Completion]] = {}
    t = threading.Thread(target=lambda: out.setdefault("result", fn()), daemon=True)
    t.start()
    return t, out


def _wait_in_flight(engine: GenerationEngine, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 30
    while engine.in_flight == 0:
        assert thread.is_alive() and time.monotonic() < deadline, "generate never started"
        time.sleep(0.001)


def test_generate_blocks_while_paused_and_runs_after_resume(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    engine = new_engine()
    engine.pause()
    thread, out = _in_thread(lambda: engine.generate(prompts, SamplingParams(max_new_tokens=4)))
    time.sleep(0.3)
    assert thread.is_alive() and "result" not in out and engine.in_flight == 0
    engine.resume()
    thread.join(timeout=30)
    assert len(out["result"]) == len(prompts)


def test_pause_returns_only_after_in_flight_generate_finished(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    engine = new_engine()
    thread, out = _in_thread(lambda: engine.generate(prompts * 3, SamplingParams(max_new_tokens=150, seed=1)))
    _wait_in_flight(engine, thread)
    engine.pause()
    # in_flight drops to 0 only when generate has produced its result, so pause() waited for it.
    assert engine.in_flight == 0
    thread.join(timeout=30)
    assert all(c.finish_reason in ("stop", "length") for c in out["result"])  # finished, not cut short
    engine.resume()


def test_abort_returns_in_flight_generate_early_and_later_calls_are_unaffected(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    engine = new_engine()
    long = SamplingParams(max_new_tokens=5000, seed=2)
    thread, out = _in_thread(lambda: engine.generate(prompts * 3, long))
    _wait_in_flight(engine, thread)
    engine.abort()
    thread.join(timeout=30)
    assert not thread.is_alive(), "abort did not stop generate"
    comps = out["result"]
    assert any(c.finish_reason == "abort" for c in comps)
    assert all(c.finish_reason in ("stop", "abort") for c in comps)
    assert all(len(c.token_ids) < 5000 for c in comps)
    later = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert all(c.finish_reason in ("stop", "length") for c in later)


def test_abort_pause_update_resume_is_a_fast_weight_sync(
    new_engine: Callable[..., GenerationEngine], models: dict[str, Path], prompts: list[list[int]]
) -> None:
    engine = new_engine("a")
    new_weights = load_causal_lm(models["b"]).state_dict()
    thread, out = _in_thread(lambda: engine.generate(prompts * 3, SamplingParams(max_new_tokens=5000)))
    _wait_in_flight(engine, thread)
    engine.abort()
    engine.pause()
    engine.update_weights(new_weights.items(), version=1)
    engine.resume()
    thread.join(timeout=30)
    assert any(c.finish_reason == "abort" for c in out["result"])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert _rows(engine.generate(prompts, greedy)) == _rows(new_engine("b").generate(prompts, greedy))


def test_micro_batches_give_the_same_greedy_completions(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    whole = new_engine().generate(prompts, greedy)
    split = new_engine(micro_batch=5).generate(prompts, greedy)
    assert _rows(whole) == _rows(split)
    for a, b in zip(whole, split, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_call_joining_requests_samples_each_row_as_its_own_request_did(
    new_engine: Callable[..., GenerationEngine], prompts: list[list[int]]
) -> None:
    engine = new_engine()
    a = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    b = replace(a, seed=6)
    first, second = prompts[:5], prompts[5:]
    alone = engine.generate(first, a) + engine.generate(second, b)
    joined = engine.generate(first + second, replace(a, row_seeds=a.seeds(len(first)) + b.seeds(len(second))))
    assert _rows(joined) == _rows(alone)
    assert _rows(alone) != _rows(engine.generate(prompts, a))  # the seeds, not the prompts, made them equal
    with pytest.raises(EngineError, match="3 row seeds for 2 prompts"):
        engine.generate(prompts[:2], replace(a, row_seeds=(1, 2, 3)))


def test_sampling_params_refuse_row_seeds_outside_the_seed_range() -> None:
    with pytest.raises(ValueError, match=r"row_seeds must be integers in \[0, 2\*\*63 - 1\), got \[-1\]"):
        SamplingParams(row_seeds=(3, -1))
    assert SamplingParams(seed=9).rows(4, 8).seeds(4) == SamplingParams(seed=9).seeds(8)[4:]


def test_bad_prompts_are_rejected_with_the_row(new_engine: Callable[..., GenerationEngine]) -> None:
    engine = new_engine()
    with pytest.raises(EngineError, match="prompt 1 is empty"):
        engine.generate([[4], []], SamplingParams())
    with pytest.raises(EngineError, match="prompt 0 has token ids outside the vocabulary"):
        engine.generate([[10**6]], SamplingParams())
