"""The learning benchmark (bench/learn.py): its clock, its summary against the targets, its fleet config,
and the TRL phase end to end in the CPU dry run (a tiny model, TRL without vLLM)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.learn import W, fleet_points, parse_runs, run_config
from bench.learn_report import RUN_FILE, at_step, load_runs, reach_time, spread, summarize_task

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


def _run(points: list[tuple[int, float, float]], first: float, cold: bool = False) -> dict[str, Any]:
    return {"ok": True, "points": [{"step": s, "clock_s": c, "accuracy": a} for s, c, a in points],
            "first_step_s": first, "steps": points[-1][0], "vllm_cold": cold, "median": {"step_s": 1.0}}


def test_the_summary_takes_medians_over_seeds_and_times_the_fleet_to_trls_median_final() -> None:
    trl = [_run([(0, 80, 0.0), (50, 150, 0.2), (100, 220, 0.3)], 80, cold=True),
           _run([(0, 70, 0.0), (50, 140, 0.25), (100, 210, 0.4)], 70),
           _run([(0, 70, 0.0), (50, 140, 0.1), (100, 210, 0.2)], 70)]
    fleet = [_run([(0, 40, 0.0), (50, 70, 0.3), (100, 100, 0.45)], 40, cold=True),
             _run([(0, 30, 0.0), (50, 60, 0.2), (100, 90, 0.35)], 30),
             _run([(0, 30, 0.0), (50, 60, 0.1), (100, 90, 0.25)], 30)]
    s = summarize_task({"trl": trl, "fleet": fleet})
    assert s["trl_median_final"] == 0.3
    c, t = s["configs"]["fleet"], s["configs"]["trl"]
    assert c["final"] == {"median": 0.35, "min": 0.25, "max": 0.45, "n": 3, "missing": 0}
    # TRL's median final (30%): TRL's seeds at 220 s, 210 s and never; the fleet's at 70 s, 90 s, never.
    assert t["time_to_trl_median_final"]["median"] == 220 and t["time_to_trl_median_final"]["missing"] == 1
    assert c["time_to_trl_median_final"]["median"] == 90
    assert c["time_ratio"] == pytest.approx(90 / 220) and c["target_half_time_met"]
    # Per step: the fleet's median is inside TRL's range at steps 50 and 100.
    assert c["per_step"]["50"]["median"] == 0.2 and t["per_step"]["50"]["min"] == 0.1
    assert c["target_per_step_met"] and c["per_step_checkpoints_met"] == "2/2"
    # First step: cold against cold (40 vs 80 s), warm against warm (30 vs 70 s).
    assert c["first_step_s_cold"]["median"] == 40 and t["first_step_s_warm"]["median"] == 70
    assert c["target_first_step_met"]


def test_the_targets_are_missed_when_the_fleet_learns_less_per_step_or_starts_later() -> None:
    trl = [_run([(0, 40, 0.0), (5, 90, 0.2)], 40), _run([(0, 40, 0.0), (5, 90, 0.3)], 40)]
    fleet = [_run([(0, 50, 0.0), (5, 60, 0.05)], 50), _run([(0, 50, 0.0), (5, 60, 0.1)], 50)]
    c = summarize_task({"trl": trl, "fleet": fleet})["configs"]["fleet"]
    assert not c["target_per_step_met"] and c["per_step_checkpoints_met"] == "0/1"
    assert c["time_to_trl_median_final"]["median"] is None and not c["target_half_time_met"]
    assert not c["target_first_step_met"]
    assert reach_time(trl[0]["points"], 0.05) == 90 and at_step(trl[0]["points"], 3) == 0.0
    assert spread([None, None]) == {"median": None, "min": None, "max": None, "n": 2, "missing": 2}


def test_a_trl_median_that_never_got_there_bounds_the_time_ratio_from_above() -> None:
    # TRL's median final 45%: one TRL seed reaches it at 188 s, the other never within its 240 s.
    trl = [_run([(0, 48, 0.0), (50, 188, 0.53)], 48), _run([(0, 50, 0.0), (60, 240, 0.375)], 50)]
    fast = [_run([(0, 50, 0.0), (100, 100, 0.6)], 50), _run([(0, 50, 0.0), (100, 110, 0.6)], 50)]
    slow = [_run([(0, 50, 0.0), (100, 150, 0.6)], 50), _run([(0, 50, 0.0), (100, 160, 0.6)], 50)]
    s = summarize_task({"trl": trl, "fleet": fast, "fleet-on-policy": slow})
    t, c, d = s["configs"]["trl"], s["configs"]["fleet"], s["configs"]["fleet-on-policy"]
    assert t["time_to_trl_median_final"]["median"] is None
    assert t["time_to_trl_median_final_at_least"] == pytest.approx((188 + 240) / 2)
    assert c["time_ratio"] is None and c["time_ratio_at_most"] == pytest.approx(105 / 214)
    assert c["target_half_time_met"]  # TRL's median is more than 214 s, so the ratio less than 0.49
    assert d["time_ratio_at_most"] == pytest.approx(155 / 214) and not d["target_half_time_met"]


def test_a_first_step_with_no_trl_run_in_the_same_cache_state_is_not_measured_rather_than_missed() -> None:
    trl = [_run([(0, 120, 0.0), (5, 130, 0.2)], 120, cold=True)]
    fleet = [_run([(0, 50, 0.0), (5, 60, 0.3)], 50)]  # warm only, against a cold TRL
    c = summarize_task({"trl": trl, "fleet": fleet})["configs"]["fleet"]
    assert c["target_first_step_met"] is None


def test_runs_are_read_by_their_file_names_and_failed_ones_left_out(tmp_path: Path) -> None:
    (tmp_path / "chain_sum-trl-s2.json").write_text(json.dumps(_run([(0, 1, 0.0), (5, 2, 0.1)], 1)))
    (tmp_path / "chain_sum-fleet-s0.json").write_text(json.dumps({"ok": False, "error": "boom"}))
    (tmp_path / "summary.json").write_text("{}")
    runs = load_runs(tmp_path)
    assert list(runs) == ["chain_sum"] and list(runs["chain_sum"]) == ["trl"]
    assert runs["chain_sum"]["trl"][0]["seed"] == 2


def test_a_run_list_names_configurations_and_seeds() -> None:
    assert parse_runs("trl:0, fleet:2,fleet-on-policy:1") == [("trl", 0), ("fleet", 2), ("fleet-on-policy", 1)]
    for bad in ("ppo:0", "trl", "trl:x"):
        with pytest.raises(ValueError, match="bad run"):
            parse_runs(bad)


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_the_fleet_phase_runs_the_example_with_gpu_settings_that_validate(task: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from services.core.config.run import RunConfig

    monkeypatch.setitem(W, "task", task)
    cfg = RunConfig.model_validate(run_config(Path("/models/smollm2"), Path("/runs/learn")))
    assert cfg.task.source == "reasoning_gym" and cfg.task.name == task
    assert cfg.algo.minibatch_size == cfg.batch.prompts_per_step * cfg.algo.group_size  # one step per round
    assert cfg.flow.max_staleness == 1 and cfg.run.eval_every > 0 and cfg.algo.compile is False
    assert cfg.algo.behaviour_correction == "sequence_mask" and cfg.algo.behaviour_weight_cap == 3.0


def test_each_configuration_changes_only_its_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.learn import CONFIGS, settings_of
    from services.core.config.run import RunConfig

    algo, compiled, messages, joined = {}, {}, {}, {}
    for config in CONFIGS:
        for k, v in settings_of(config).items():
            monkeypatch.setitem(W, k, v)
        cfg = RunConfig.model_validate(run_config(Path("/models/smollm2"), Path("/runs/learn")))
        algo[config] = (cfg.flow.max_staleness, cfg.algo.proximal, cfg.algo.tf32, cfg.algo.micro_batch_size)
        compiled[config] = cfg.algo.compile, cfg.algo.autocast
        messages[config] = cfg.batch.prompts_per_step // cfg.batch.prompts_per_message
        joined[config] = cfg.generation.batch_messages
    assert algo["fleet"] == (1, "current", None, 64)  # rlfleet's default: TF32 on a CUDA GPU
    assert algo["fleet-fp32"] == (1, "current", False, 64)
    assert algo["fleet-on-policy"] == (0, "current", None, 64)
    assert algo["fleet-sampled"] == (1, "sampled", None, 64)
    assert algo["fleet-mb256"] == (1, "current", None, 256) == (*algo["fleet"][:3], cfg.algo.minibatch_size)
    assert algo["fleet-mb256-compiled"] == algo["fleet-mb256-bf16"] == algo["fleet-mb256-1msg"] == algo["fleet-mb256"]
    assert algo["fleet-mb256-joined"] == algo["fleet-mb256"]
    assert {c: n for c, n in joined.items() if n != 8} == {"fleet-mb256": 1}  # its recorded runs: a call per message
    assert {c: n for c, n in messages.items() if n != 4} == {"fleet-mb256-1msg": 1}  # a step is four messages
    assert {c: v for c, v in compiled.items() if v != (False, None)} == {
        "fleet-mb256-compiled": (True, None), "fleet-mb256-bf16": (False, "bfloat16")}
    assert settings_of("trl")["micro_batch"] == 64  # TRL's per-device batch stays the shared one
    assert settings_of("trl")["tf32"] is None and settings_of("trl-tf32")["tf32"] is True


@pytest.mark.slow
def test_dry_run_trains_trl_and_reports_it_against_the_recorded_fleet_runs(tmp_path: Path) -> None:
    """The TRL run end to end on the CPU (its evaluation callback, the clock, the budget, its own
    process), and the report over its result and the fleet runs recorded on the GPU (the fleet run
    itself is a `rlfleet up` monitored for its metrics rows: the e2e tests run that fleet, the unit
    test above its clock)."""
    pytest.importorskip("trl", reason="TRL is the peer; without it there is nothing to compare")
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.learn", "run", "--runs", "trl:0", "--budget-s", "8",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "basic_arithmetic-trl-s0.json").read_text())
    assert res["ok"], res.get("error")
    clocks = [p["clock_s"] for p in res["points"]]
    assert len(clocks) >= 2 and clocks == sorted(clocks) and clocks[0] > 0
    assert res["points"][0]["step"] == 0 and res["first_step_s"] > 0 and res["vllm_cold"] is True
    # TRL's own per-step log comes along, to set its entropy and rewards beside the fleet's rows.
    assert len(res["log_history"]) >= res["steps"] and {"reward", "entropy"} <= set(res["log_history"][0])
    recorded = sorted((REPO / "bench" / "results" / "learn").glob("basic_arithmetic-fleet*-s[0-9]*.json"))
    assert recorded, "the fleet runs recorded on the GPU are in bench/results/learn"
    seeds: dict[str, list[int]] = {}
    for f in recorded:
        shutil.copy(f, out / f.name)
        m = RUN_FILE.match(f.stem)
        assert m is not None, f.name
        seeds.setdefault(m["config"], []).append(int(m["seed"]))
    proc = subprocess.run([sys.executable, "-m", "bench.learn", "report", "--results", str(out), "--no-benchmarks-md"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())["summary"]["basic_arithmetic"]
    for config, ss in seeds.items():
        assert summary["configs"][config]["seeds"] == sorted(ss), config
    assert summary["configs"]["trl"]["steps"]["median"] == res["steps"]
    assert (out / "basic_arithmetic.png").stat().st_size > 0


def test_a_fleet_runs_service_logs_are_kept_beside_its_result_as_one_archive(tmp_path: Path) -> None:
    import tarfile

    from bench.learn import _keep_service_logs

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "actor.log").write_text("engine ready\n")
    dest = tmp_path / "out" / "basic_arithmetic-fleet-s0-logs.tgz"
    dest.parent.mkdir()
    _keep_service_logs(logs, dest)
    with tarfile.open(dest) as tar:
        assert tar.getnames() == ["basic_arithmetic-fleet-s0-logs", "basic_arithmetic-fleet-s0-logs/actor.log"]
    _keep_service_logs(tmp_path / "never-started", tmp_path / "out" / "none.tgz")  # no logs, no archive
    assert not (tmp_path / "out" / "none.tgz").exists()
