"""The TRL peer runner (`python -m bench.trl_peer`) still runs end to end on CPU with a tiny Qwen2 and the
word-level synthetic task, so that the one-shot GPU run it exists for does not fail on something a CPU
could have caught. Timings are not asserted beyond being positive."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import trl_peer

REPO = Path(__file__).resolve().parents[2]


def _step(i: int, seconds: float, tokens: int, completions: int = 4) -> dict[str, Any]:
    return {"step": i + 1, "t_begin": 10.0 * i, "t_end": 10.0 * i + seconds, "seconds": seconds,
            "completions": completions, "completion_tokens": tokens}


def test_steady_state_drops_warmup_and_takes_medians() -> None:
    steps = [_step(0, 100.0, 1), _step(1, 2.0, 40), _step(2, 4.0, 40), _step(3, 3.0, 40)]
    st = trl_peer.steady_state(steps, warmup=1)
    assert st["steps_measured"] == 3
    assert st["median_step_s"] == pytest.approx(3.0)
    assert st["samples_per_s"] == pytest.approx(4 / 3.0)
    assert st["tokens_per_s"] == pytest.approx(40 / 3.0)
    # From step 2's begin (10) to step 4's end (33): 12 completions, 120 tokens.
    assert st["window_s"] == pytest.approx(23.0)
    assert st["window_samples_per_s"] == pytest.approx(12 / 23.0)
    assert st["window_tokens_per_s"] == pytest.approx(120 / 23.0)


def test_steady_state_with_no_measured_step_has_no_figures() -> None:
    st = trl_peer.steady_state([_step(0, 1.0, 8)], warmup=1)
    assert st["steps_measured"] == 0
    assert st["median_step_s"] is None and st["samples_per_s"] is None and st["tokens_per_s"] is None


def test_completion_tokens_prefer_trl_logged_mean_length() -> None:
    assert trl_peer.completion_tokens_of({"completions/mean_length": 7.5}, 4, 8) == (30, "trl_logged_mean_length")
    assert trl_peer.completion_tokens_of({}, 4, 8) == (32, "budget")
    assert trl_peer.completion_tokens_of({"completions/mean_length": None}, 4, 8) == (32, "budget")


def test_json_safe_turns_non_finite_floats_into_null() -> None:
    assert trl_peer.json_safe({"a": float("nan"), "b": [1.0, float("inf")], "c": (1, "x")}) == {
        "a": None, "b": [1.0, None], "c": [1, "x"]}


def test_micro_batch_must_divide_the_completions_of_a_step() -> None:
    with pytest.raises(SystemExit) as exc:
        trl_peer.parse_args(["--model", "m", "--out", "o.json", "--prompts-per-step", "3", "--group", "2",
                             "--micro-batch", "4"])
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install trl==1.16.0)")
def test_trl_peer_runs_grpo_on_cpu_and_writes_its_json(tmp_path: Path) -> None:
    import transformers

    from services.models.tokenizer import build_tokenizer_from_vocab
    from services.tasks.synthetic import SyntheticTask

    model_dir = tmp_path / "model"
    task = SyntheticTask({"prompt_tokens": 8, "completion_tokens": 8, "words": 200})
    tok = build_tokenizer_from_vocab(task.vocab(), "word")
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=len(tok), bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    out = tmp_path / "trl.json"
    cmd = [sys.executable, "-m", "bench.trl_peer", "--model", str(model_dir), "--out", str(out), "--device", "cpu",
           "--prompts-per-step", "2", "--group", "2", "--micro-batch", "2", "--steps", "2", "--warmup", "1",
           "--prompt-tokens", "8", "--completion-tokens", "8", "--words", "200"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    res = json.loads(out.read_text())
    assert res["ok"] is True and res["framework"] == "trl" and res["device"] == "cpu"
    assert res["trl_version"] and res["transformers_version"] and res["torch_version"]
    for key, value in {"prompts_per_step": 2, "group": 2, "micro_batch": 2, "steps": 2, "warmup": 1,
                       "prompt_tokens": 8, "completion_tokens": 8, "words": 200, "kl_coef": 0.04,
                       "gradient_accumulation_steps": 2, "completions_per_step": 4}.items():
        assert res["config"][key] == value, key
    assert res["grpo_config"]["generation_batch_size"] == 4 and res["grpo_config"]["num_generations"] == 2

    steps = res["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["completions"] == 4
        assert s["seconds"] > 0 and s["t_end"] > s["t_begin"] and s["wall_end"] >= s["wall_begin"]
        assert "completions/mean_length" in s["logs"]
    assert all(a["t_end"] <= b["t_begin"] for a, b in itertools.pairwise(steps))
    # min_new_tokens forces every completion to the full budget: 4 completions x 8 tokens.
    assert res["exact_length_completions"] is True
    assert res["completion_tokens_source"] == "trl_logged_mean_length"
    assert [s["completion_tokens"] for s in steps] == [32, 32, 32]

    st = res["steady"]
    assert st["steps_measured"] == 2
    assert st["median_step_s"] > 0 and st["samples_per_s"] > 0 and st["tokens_per_s"] > 0
    assert st["tokens_per_s"] == pytest.approx(st["samples_per_s"] * 8)

    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["samples_per_s"] == pytest.approx(st["samples_per_s"])
