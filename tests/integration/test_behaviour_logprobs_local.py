"""The single-process loop with generation.behaviour_logprobs "trainer": the engine reports no log-probs,
the trainer scores every batch itself, and a run with a KL-in-loss reference trains with finite losses
and no rollout "kl" metric (it would be KL from zeros)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.local import run_local
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.shares_host]


def test_a_local_run_without_engine_logprobs_trains_with_finite_losses(tmp_path: Path, tiny_model: Path) -> None:
    cfg = tiny_config(tmp_path, tiny_model, run={"max_steps": 2, "eval_every": 0}, task={"eval_size": 0},
                      algo={"kl_coef": 0.05, "kl_in": "loss", "minibatch_size": 4096, "ppo_epochs": 1},
                      generation={"behaviour_logprobs": "trainer"})
    rows = read_metrics(run_local(cfg))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("policy_loss", "kl_loss", "entropy", "grad_norm")), r
        assert "kl" not in r and r["behaviour_weight_mean"] == 1.0
        # One update per step, clipped against the trainer's own forward of the same weights.
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and r["clip_frac"] == 0.0
