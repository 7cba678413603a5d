"""The single-process loop with token-budget micro-batches in every stage that has them (policy and value
training, the reference and critic scoring): the same run as whole-minibatch forwards. The tiny task's
sequences (6 to 9 tokens) leave no room to pack two in a row as wide as the longest, so this pins the
wiring and the re-laid-out rows; several sequences per row are pinned in tests/unit/test_rl_packing.py
and test_rl_trainer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.local import run_local
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = pytest.mark.shares_host

KEYS = ("reward_mean", "adv_abs_mean", "policy_loss", "kl_loss", "value_loss", "entropy")


def test_packed_token_budgets_train_ppo_like_whole_minibatches(tmp_path: Path, tiny_model: Path) -> None:
    # PPO with a KL term runs all four stages; 48 tokens hold 5 or 6 of the tiny task's sequences, so
    # each minibatch of 32 takes several forwards.
    algo = {"name": "ppo", "kl_coef": 0.05, "minibatch_size": 32, "ppo_epochs": 1}
    runs = {}
    for name, extra in (("whole", {}), ("packed", {"micro_batch_tokens": 48, "pack_sequences": True})):
        cfg = tiny_config(tmp_path / name, tiny_model, run={"max_steps": 1, "eval_every": 0},
                          task={"eval_size": 0}, algo={**algo, **extra})
        runs[name] = read_metrics(run_local(cfg))
    (whole,), (packed,) = runs["whole"], runs["packed"]
    for key in KEYS:
        assert key in whole and packed[key] == pytest.approx(whole[key], abs=1e-5), key
