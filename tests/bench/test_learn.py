"""The learning benchmark (bench/learn.py): its clock, its summary against the targets, its fleet config,
and the TRL phase end to end in the CPU dry run (a tiny model, TRL without vLLM)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.learn import fleet_points, run_config
from bench.learn_report import at_step, reach_time, summarize

pytestmark = pytest.mark.shares_host  # TRL's dry run in one process, bounded by a generous timeout

REPO = Path(__file__).resolve().parents[2]


def _row(step: int, t: float, acc: float | None, eval_s: float | None = None, **extra: float) -> dict[str, float]:
    row: dict[str, float] = {"step": step, "time": t, "step_s": 1.0, **extra}
    if acc is not None:
        row.update(eval_accuracy_greedy=acc, eval_s=eval_s if eval_s is not None else 2.0)
    return row


def test_fleet_points_take_every_evaluation_off_the_clock() -> None:
    launch = 1000.0
    rows = [_row(1, 1100.0, None, eval_accuracy_greedy_before=0.01), _row(2, 1102.0, 0.05, eval_s=4.0),
            _row(3, 1103.0, None), _row(4, 1110.0, 0.2, eval_s=6.0)]
    pts = fleet_points(rows, launch)
    assert [p["step"] for p in pts] == [0, 2, 4]
    # The evaluation before training is charged at the median of the timed ones (5 s).
    assert pts[0]["accuracy"] == 0.01 and pts[0]["clock_s"] == pytest.approx(100.0 - 5.0)
    assert pts[1]["clock_s"] == pytest.approx(102.0 - 5.0 - 4.0)
    assert pts[2]["clock_s"] == pytest.approx(110.0 - 5.0 - 4.0 - 6.0)


def test_summary_says_when_the_fleet_reaches_trls_final_accuracy() -> None:
    fleet = {"points": [{"step": 0, "clock_s": 50.0, "accuracy": 0.01}, {"step": 50, "clock_s": 80.0, "accuracy": 0.3},
                        {"step": 100, "clock_s": 110.0, "accuracy": 0.5}]}
    trl = {"points": [{"step": 0, "clock_s": 40.0, "accuracy": 0.01}, {"step": 50, "clock_s": 150.0, "accuracy": 0.2},
                      {"step": 100, "clock_s": 260.0, "accuracy": 0.3}]}
    s = summarize(fleet, trl)
    assert s["fleet_gain_points"] == pytest.approx(49.0) and s["target_gain_met"]
    assert s["trl_time_to_final"] == 260.0 and s["fleet_time_to_trl_final"] == 80.0
    assert s["time_ratio"] == pytest.approx(80.0 / 260.0) and s["target_half_time_met"]
    assert s["per_step"]["100"] == {"fleet": 0.5, "trl": 0.3} and s["per_step"]["200"] == {"fleet": None, "trl": None}


def test_summary_misses_the_time_target_when_the_fleet_never_gets_there() -> None:
    fleet = {"points": [{"step": 0, "clock_s": 50.0, "accuracy": 0.0}, {"step": 5, "clock_s": 60.0, "accuracy": 0.05}]}
    trl = {"points": [{"step": 0, "clock_s": 40.0, "accuracy": 0.0}, {"step": 5, "clock_s": 90.0, "accuracy": 0.2}]}
    s = summarize(fleet, trl)
    assert s["fleet_time_to_trl_final"] is None and not s["target_half_time_met"]
    assert not s["target_gain_met"]  # +5 points
    assert reach_time(trl["points"], 0.05) == 90.0 and at_step(trl["points"], 3) == 0.0


def test_the_fleet_phase_runs_the_example_with_gpu_settings_that_validate() -> None:
    from services.core.config import RunConfig

    cfg = RunConfig.model_validate(run_config(Path("/models/smollm2"), Path("/runs/learn")))
    assert cfg.task.source == "reasoning_gym" and cfg.task.name == "basic_arithmetic"
    assert cfg.algo.minibatch_size == cfg.batch.prompts_per_step * cfg.algo.group_size  # one step per round
    assert cfg.flow.max_staleness == 1 and cfg.run.eval_every > 0


@pytest.mark.slow
def test_dry_run_trains_trl_and_reports_it_against_the_recorded_fleet_run(tmp_path: Path) -> None:
    """The TRL phase end to end on the CPU (its evaluation callback, the clock, the budget), and the
    report over its result and the fleet run recorded on the H200 (the fleet phase itself is a
    `rlfleet up` monitored for its metrics rows: the e2e tests run that fleet, the unit test above
    its clock)."""
    pytest.importorskip("trl", reason="TRL is the peer; without it there is nothing to compare")
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.learn", "trl", "--budget-s", "8", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "trl.json").read_text())
    assert res["ok"], res.get("error")
    clocks = [p["clock_s"] for p in res["points"]]
    assert len(clocks) >= 2 and clocks == sorted(clocks) and clocks[0] > 0
    assert res["points"][0]["step"] == 0 and res["first_step_s"] > 0
    shutil.copy(REPO / "bench" / "results" / "learn" / "fleet.json", out / "fleet.json")
    proc = subprocess.run([sys.executable, "-m", "bench.learn", "report", "--results", str(out), "--no-benchmarks-md"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["fleet_steps"] == 396 and summary["trl_steps"] == res["steps"]
    assert (out / "accuracy.png").stat().st_size > 0
