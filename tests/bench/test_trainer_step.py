"""bench/trainer_step.py in its CPU dry run: one step of the learning benchmark taken apart, every phase
written to its result (the GPU run's figures come from the same code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.trainer_step import VARIANTS

pytestmark = pytest.mark.shares_host  # one process, a tiny model, bounded by its timeout

REPO = Path(__file__).resolve().parents[2]


def test_the_dry_run_times_generation_sync_and_each_trainer_variant_on_a_real_batch(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")}
    proc = subprocess.run([sys.executable, "-m", "bench.trainer_step", "--out", str(out), "--steps", "1",
                           "--variants", "mb64,mb256-bf16"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["batch"]["rows"] == 8 and res["batch"]["response_tokens"] > 0  # the dry run's 4 prompts x 2
    assert res["generate_alone"]["median"] > 0 and res["weight_sync"]["median"] > 0
    # the step's generation as the actor makes it: one engine call per prompt message (1 prompt x 2 here)
    assert res["generate_in_messages"]["messages"] == 4 and res["generate_in_messages"]["rows_per_message"] == 2
    assert res["generate_in_messages"]["median"] > 0
    assert res["overlapped"]["generate"]["median"] > 0 and res["overlapped"]["train_step"]["median"] > 0
    assert list(res["variants"]) == ["mb64", "mb256-bf16"]
    for v in res["variants"].values():
        assert v["train_step"]["median"] > 0 and v["profile"]["wall_s"] > 0 and v["profile"]["top"]


def test_an_unknown_variant_is_one_line_naming_it() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.trainer_step", "--out", "/nonexistent/x.json",
                           "--variants", "mb64,mb999"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"bench.trainer_step: unknown variant(s) mb999: pick from {', '.join(VARIANTS)}"]
