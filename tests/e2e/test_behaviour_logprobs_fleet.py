"""The fleet with generation.behaviour_logprobs "trainer": the actor's engine (in its own process, so
the switch crosses the process boundary) reports no log-probs, the actor's trainer scores every batch
itself, and the controller leaves the rollout "kl" metric out; step for step the single-process loop."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.local import run_local
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.slow


def test_fleet_without_engine_logprobs_learns_like_the_local_loop(tmp_path: Path, tiny_model: Path,
                                                                   fleet_factory) -> None:
    steps, run = 2, {"max_steps": 2, "eval_every": 0}
    local = read_metrics(run_local(tiny_config(tmp_path / "local", tiny_model, run=run, task={"eval_size": 16},
                                               generation={"behaviour_logprobs": "trainer"})))
    cfg = tiny_config(tmp_path / "fleet", tiny_model, run=run, task={"eval_size": 16},
                      generation={"behaviour_logprobs": "trainer", "process": True})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    assert fleet.supervise(timeout_s=240) == 0
    remote = read_metrics(tmp_path / "fleet" / "metrics.jsonl")
    assert [r["step"] for r in remote] == list(range(1, steps + 1))
    for a, b in zip(local, remote, strict=True):
        assert "kl" not in b and b["behaviour_weight_mean"] == 1.0
        for k in ("reward_mean", "policy_loss", "kl_loss"):
            assert math.isfinite(b[k]) and b[k] == pytest.approx(a[k], abs=1e-4), k
