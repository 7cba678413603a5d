"""DAPO with dynamic sampling as a real fleet, on the tiny CPU task with a 0/1 reward and groups of
four (so some groups are certainly all-equal): the controller is killed (SIGKILL) right after it
dropped a group in the middle of the run, the supervisor restarts it, and the run still drops,
admits and trains exactly what the single-process loop does, step for step; the journal holds the
dropped groups, every step trained a full batch, and the audit passes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.audit import audit
from services.core.faults import ENV, fault_dir
from services.core.journal.journal import Journal, TaskState
from services.fleet import Fleet
from services.local import run_local
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 4
SECTIONS: dict[str, dict[str, Any]] = {
    "run": {"max_steps": STEPS, "eval_every": 0},
    "task": {"eval_size": 0},
    "algo": {"name": "dapo", "group_size": 4, "overlong_buffer_len": 1, "ppo_epochs": 1, "minibatch_size": 32},
    "batch": {"prompts_per_step": 8, "prompts_per_message": 4},
    "flow": {"resend_after_s": 4.0, "reclaim_idle_ms": 1500, "rpc_timeout_s": 120.0},
}


def _first_drop_at_or_after(events: Path, step: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if events.exists():
            for line in events.read_text().splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("kind") == "dropped" and ev.get("step", 0) >= step:
                    return dict(ev)
        time.sleep(0.05)
    raise TimeoutError(f"no group dropped for step {step} within {timeout_s}s")


def _reached(run_dir: Path, point: str, timeout_s: float) -> None:
    marker = fault_dir(run_dir) / f"{point}.reached"
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not reach {point} within {timeout_s}s")
        time.sleep(0.05)


# Killed while admitting (step 2's batch not full yet, a group just dropped), or with step 2's batch
# journaled but not trained: the replacement resumes exactly that batch and its row keeps its figures.
@pytest.mark.parametrize("crash", ["after_a_drop", "step_journaled@2"])
def test_fleet_drops_equal_groups_like_the_local_loop_across_a_controller_crash(
    crash: str, tmp_path: Path, tiny_model: Path, fleet_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = read_metrics(run_local(tiny_config(tmp_path / "local", tiny_model, **SECTIONS)))
    cfg = tiny_config(tmp_path / "fleet", tiny_model, **SECTIONS)
    if crash != "after_a_drop":
        monkeypatch.setenv(ENV, crash)
    fleet: Fleet = fleet_factory(cfg, restart_budget=2)
    fleet.start(ready_timeout_s=180)
    result: list[Any] = []

    def supervise() -> None:
        try:
            result.append(fleet.supervise(timeout_s=480, poll_s=0.2))
        except BaseException as e:  # surfaced by the assertion below
            result.append(e)

    sup = threading.Thread(target=supervise, daemon=True)
    sup.start()
    drop = _first_drop_at_or_after(cfg.run_dir / "events.jsonl", 2, timeout_s=300)
    if crash != "after_a_drop":
        _reached(cfg.run_dir, crash, timeout_s=300)
    os.kill(fleet.procs["controller"].proc.pid, signal.SIGKILL)
    sup.join(timeout=540)
    assert result == [0], f"supervise returned {result}"
    assert fleet.procs["controller"].restarts == 1

    j = Journal.open(cfg.journal_dir, readonly=True, stages=cfg.stages())
    try:
        dropped = [r for r in j.iter_tasks() if r.state is TaskState.DROPPED]
        counts = j.counts()
    finally:
        j.close()
    assert drop["task_ids"][0] in {r.task_id for r in dropped}  # what was dropped before the crash stayed so
    assert counts["trained"] == STEPS * cfg.samples_per_step and counts["dead"] == 0
    filtered = [r for r in dropped if (r.reason or "").startswith("filtered: all rewards equal")]
    assert filtered and len(filtered) % 4 == 0
    report = audit(cfg.run_dir, finished=True)
    assert report.ok, report.render()

    fleet_rows = {r["step"]: r for r in read_metrics(cfg.run_dir / "metrics.jsonl")}
    assert sorted(fleet_rows) == list(range(1, STEPS + 1))
    compared = 0
    for a in local:
        b = fleet_rows[a["step"]]
        if "recovered" in b:  # committed just before the crash: its row was back-filled without figures
            continue
        compared += 1
        for key in ("dropped_groups", "surplus_groups", "admitted_prompts"):
            assert b[key] == a[key], (a["step"], key)
        for key in ("reward_mean", "adv_abs_mean", "policy_loss"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (a["step"], key)
    assert compared >= STEPS - 1
    if crash != "after_a_drop":
        assert fleet_rows[2].get("resumed") == 1.0 and compared == STEPS


def _flat_reward_config(tmp_path: Path, tiny_model: Path) -> Path:
    """A dapo run whose reward is the same for every completion: every group is dropped."""
    (tmp_path / "flat.py").write_text(
        "def flat(completions, **fields):\n    return [0.5 for _ in completions]\n")
    cfg = tiny_config(tmp_path / "run", tiny_model, run={"max_steps": 1, "eval_every": 0},
                      task={"eval_size": 0, "reward_path": str(tmp_path / "flat.py:flat")},
                      algo={"name": "dapo", "group_size": 2, "dynamic_sampling_max_rounds": 2},
                      batch={"prompts_per_step": 4, "prompts_per_message": 4})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def test_a_step_that_only_finds_equal_rewards_stops_train_local_with_one_line_naming_the_bound(
    tmp_path: Path, tiny_model: Path
) -> None:
    from tests.e2e.test_cli import assert_one_line_error, rlfleet

    path = _flat_reward_config(tmp_path, tiny_model)
    p = rlfleet("train", "--local", "--config", str(path), timeout=300)
    line = assert_one_line_error(p, "step 1 dropped 8 groups", "algo.dynamic_sampling_max_rounds 2")
    assert line.startswith("rlfleet train: dynamic sampling:"), line
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == []  # nothing was trained


def test_a_fleet_step_that_only_finds_equal_rewards_stops_the_run_on_one_line_without_restarts(
    tmp_path: Path, tiny_model: Path
) -> None:
    from tests.e2e.test_cli import assert_one_line_error, rlfleet

    path = _flat_reward_config(tmp_path, tiny_model)
    p = rlfleet("up", "--config", str(path), timeout=300)
    # Every group of a batch dropped must not crash the controller, and its exit code 2 (a run that
    # cannot go on as configured) must stop the run rather than spend the restart budget on it.
    line = assert_one_line_error(p, "controller stopped", "algo.dynamic_sampling_max_rounds 2")
    assert "died" not in line, line
