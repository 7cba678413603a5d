"""The rlfleet-vs-TRL harness end to end in its CPU dry run (tiny model, transformers engine): every
phase runs, the results JSON holds steady-state figures, and the report renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_measures_every_phase_and_renders_the_report(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is the peer; without it there is nothing to compare")
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "run", "--out", str(out), "--deadline-s", "400"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("vs_trl-*.json")
    res = json.loads(path.read_text())
    ph = res["phases"]
    for name in ("trl", "fleet-vllm-grpo-proc", "fleet-vllm-grpo", "fleet-vllm-ppo", "fleet-hf-grpo"):
        assert ph[name].get("ok"), (name, ph[name].get("error"), ph[name].get("log_tail"))
        assert ph[name]["samples_per_s"] > 0 and ph[name]["steps_measured"] >= 2
    assert ph["vllm-alone"]["error"] == "vllm is not installed"
    # The PPO fleet times its critic stages; GRPO has none.
    assert {"generate", "reference", "reward", "actor_train", "weight_sync", "advantage"} <= set(
        ph["fleet-vllm-grpo"]["stages"])
    assert {"critic", "critic_train"} <= set(ph["fleet-vllm-ppo"]["stages"])
    md = (out / "vs_trl.md").read_text()
    assert "| TRL GRPOTrainer (generate) |" in md and "vs TRL" in md
