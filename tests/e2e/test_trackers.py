"""Experiment trackers (`run.trackers`) on real runs, read back with each library's own reader:
every metrics.jsonl row lands in TensorBoard, W&B (offline) and MLflow (file store) at its step
with the same floats, the config is logged as hyper-parameters, a tracker that fails mid-run is
disabled while the run goes on, and a restarted process continues the same tracker runs."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.core.config.run import parse_config
from services.core.observability.trackers import Trackers, read_state, row_metrics
from services.local import run_local
from services.report import read_metrics
from tests.fleet_helpers import EXAMPLE, tiny_config
from tests.tracker_readers import Rows, expected_rows, mlflow_rows, tensorboard_rows, wandb_rows

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ALL = [{"kind": "tensorboard"}, {"kind": "wandb", "mode": "offline", "project": "rlfleet-test"},
       {"kind": "mlflow", "experiment": "rlfleet-test"}]
STEPS = 3
RUN = {"max_steps": STEPS, "eval_every": 2}
TASK = {"eval_size": 8}


def _assert_same(got: Rows, want: Rows, tracker: str, lossy_before: int = 0) -> None:
    """`lossy_before`: rows of earlier steps may be missing (logged by a process killed with -9
    before its tracker's writer flushed them); every row there is still exact."""
    must = sorted(s for s in want if s >= lossy_before)
    assert set(must) <= set(got) <= set(want), (tracker, sorted(got), sorted(want))
    for step, row in ((s, r) for s, r in want.items() if s in got):
        assert got[step] == row, (tracker, step, {k: (got[step].get(k), v) for k, v in row.items()
                                                  if got[step].get(k) != v})


def _assert_all_trackers(run_dir: Path, steps: int, max_steps: int, wandb_lossy_before: int = 0) -> None:
    want = expected_rows(run_dir)
    assert sorted(want) == list(range(1, steps + 1))
    assert any(k.startswith("eval_") for k in want[steps]) and "policy_loss" in want[1]  # eval and train keys
    tb, tb_params = tensorboard_rows(run_dir / "tensorboard")
    _assert_same(tb, want, "tensorboard")
    wb, wb_config, wb_ids = wandb_rows(run_dir)
    _assert_same(wb, want, "wandb", wandb_lossy_before)
    ml, ml_params, status = mlflow_rows(run_dir, f"file:{run_dir / 'mlruns'}", set(want[1]))
    _assert_same(ml, want, "mlflow")
    assert status == "FINISHED"
    # The run's config, once, as hyper-parameters: the values a user would look for.
    assert tb_params["algo.name"] == "grpo" and ml_params["algo.name"] == "grpo"
    assert wb_config["algo"]["name"] == "grpo"
    assert tb_params["run.max_steps"] == max_steps and ml_params["run.max_steps"] == str(max_steps)
    assert wb_config["run"]["max_steps"] == max_steps
    state = read_state(run_dir)
    assert set(wb_ids) == {state["run_id"]} and "disabled" not in state  # no tracker failed on the way


def test_local_run_writes_every_metrics_row_to_each_tracker(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "local"
    run_local(tiny_config(run_dir, tiny_model, run={**RUN, "trackers": ALL}, task=TASK))
    _assert_all_trackers(run_dir, STEPS, STEPS)
    timing = read_state(run_dir)["timing"]
    assert {n: t["rows"] for n, t in timing.items()} == {"tensorboard": STEPS, "wandb": STEPS, "mlflow": STEPS}


def test_a_tracker_failing_mid_run_is_disabled_and_the_run_goes_on(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "failing"
    trackers = [{"kind": "tensorboard"}, {"kind": "mlflow"}]
    cfg = tiny_config(run_dir, tiny_model, run={**RUN, "trackers": trackers}, task=TASK)

    def lose_mlflow_run(row: dict[str, Any]) -> None:
        if row["step"] == 1:  # the store loses the run under the tracker: its next write raises
            for d in (run_dir / "mlruns").glob(f"*/{read_state(run_dir)['mlflow_run_id']}"):
                shutil.rmtree(d)

    with caplog.at_level(logging.WARNING, logger="rlfleet.trackers"):
        run_local(cfg, on_step=lose_mlflow_run)
    want = expected_rows(run_dir)
    assert sorted(want) == [1, 2, 3]  # the run finished every step
    assert (run_dir / "export" / "config.json").exists()
    _assert_same(tensorboard_rows(run_dir / "tensorboard")[0], want, "tensorboard")  # the others go on
    disabled = read_state(run_dir)["disabled"]
    assert set(disabled) == {"mlflow"}
    assert disabled["mlflow"]["phase"] == "log" and disabled["mlflow"]["step"] == 2
    assert "MlflowException" in disabled["mlflow"]["error"]
    warned = [r for r in caplog.records if r.name == "rlfleet.trackers"]
    assert len(warned) == 1 and "mlflow disabled" in warned[0].getMessage()  # logged once, not per row


def test_fleet_run_writes_every_row_to_each_tracker_through_a_controller_crash(
        tiny_model: Path, tmp_path: Path) -> None:
    """`rlfleet up` with all three trackers; the controller is killed (-9) right after committing
    step 2 and before writing its row: the supervisor's replacement back-fills that row and
    continues the same tracker runs (a second TensorBoard file and W&B folder, the same MLflow run)."""
    run_dir = tmp_path / "fleet"
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"].update(dir=str(run_dir), **RUN, trackers=ALL)
    data["task"].update(TASK)
    data["models"]["policy"] = {"path": str(tiny_model)}
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(data))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", RLFLEET_FAULT_HOOK="journal_committed@2")
    # When the local runs above ran, wandb.init left WANDB_SERVICE (its wandb-core) in this process's
    # environment: `rlfleet up` inherits it, and must not hand it to the services.
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--config", str(config)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        reached = run_dir / "faults" / "journal_committed@2.reached"
        deadline = time.monotonic() + 600
        while not (reached.exists() and reached.read_text()):
            assert up.poll() is None and time.monotonic() < deadline, "the controller never reached step 2's commit"
            time.sleep(0.1)
        mlflow_run = read_state(run_dir)["mlflow_run_id"]
        os.kill(int(reached.read_text()), signal.SIGKILL)
        out, err = up.communicate(timeout=600)
    finally:
        if up.poll() is None:  # a failed wait: stop the fleet as Ctrl-C does, so no service outlives the test
            up.send_signal(signal.SIGINT)
            try:
                up.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                up.kill()
    assert up.returncode == 0, (out[-2000:], err[-3000:])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1].get("recovered") == 1.0  # step 2's row back-filled
    # W&B's offline writer (wandb-core) may not have flushed what the killed controller logged last;
    # TensorBoard and MLflow must hold every row, and W&B every row from the back-filled one on.
    _assert_all_trackers(run_dir, STEPS, STEPS, wandb_lossy_before=2)
    assert read_state(run_dir)["mlflow_run_id"] == mlflow_run  # the same MLflow run, reopened
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # one folder per controller, one run id
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    report = (run_dir / "report.html").read_text()
    for name in ("tensorboard", "wandb", "mlflow"):  # each tracker, in the report (rows: finished processes)
        assert re.search(rf"<p>{name}: \d+ rows logged, [0-9.]+ ms a row", report), name


def test_a_restarted_process_continues_the_same_tracker_runs(tmp_path: Path) -> None:
    """What a resumed controller does (`StepRecorder.start_trackers`): the same rlfleet run id, the
    first step it will write; each tracker then holds one run with every step."""
    run_dir = tmp_path / "resumed"
    cfg = parse_config({"run": {"dir": str(run_dir), "name": "resumed", "max_steps": 3, "trackers": ALL}})
    rows = [{"step": s, "time": 0.0, "version": s, "reward_mean": s / 7, "reward/correct": 1 / (s + 2)}
            for s in (1, 2, 3)]
    run_id = uuid.uuid4().hex
    for first, part in ((1, rows[:2]), (3, rows[2:])):  # two processes: steps 1-2, then 3
        trackers = Trackers(cfg, run_id=run_id)
        trackers.start(first_step=first)
        for row in part:
            trackers.log_row(row)
        trackers.finish()
        if first == 1:
            mlflow_run = read_state(run_dir)["mlflow_run_id"]
    want = {int(r["step"]): row_metrics(r) for r in rows}
    _assert_same(tensorboard_rows(run_dir / "tensorboard")[0], want, "tensorboard")
    wb, _, wb_ids = wandb_rows(run_dir)
    _assert_same(wb, want, "wandb")
    assert wb_ids == [run_id, run_id]  # one offline folder per process, one W&B run for `wandb sync`
    assert read_state(run_dir)["mlflow_run_id"] == mlflow_run
    ml, _, status = mlflow_rows(run_dir, f"file:{run_dir / 'mlruns'}", set(want[1]))
    _assert_same(ml, want, "mlflow")
    assert status == "FINISHED"
