"""The TRL peer runner's pure parts. Its end-to-end CPU run (a tiny Qwen2, the word-level synthetic task)
is the `trl-vllm-0.5b` phase of the harness's dry run, checked in tests/bench/test_vs_trl.py."""

from __future__ import annotations

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
