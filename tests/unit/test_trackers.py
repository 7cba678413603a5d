"""The tracker section of the config and the failure model of `services.core.observability.trackers`, without
the tracker libraries: a tracker that raises is disabled, logged once and counted while the others
keep every row; start-up checks fail closed with one line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from services.cli import main
from services.core.config.run import ConfigError, parse_config
from services.core.config.trackers import MlflowSpec, TensorBoardSpec, WandbSpec
from services.core.observability.tracker_backends import MlflowTracker, TensorBoardTracker, WandbTracker, flat_params
from services.core.observability.trackers import Trackers, check_trackers, read_state, row_metrics, summary_lines

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


class Recording:
    """A tracker that keeps what it is given."""

    name = "recording"

    def __init__(self) -> None:
        self.started: tuple[Any, ...] | None = None
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.finished = 0

    def start(self, run_name: str, config: dict[str, Any], run_id: str, first_step: int) -> None:
        self.started = (run_name, config, run_id, first_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, metrics))

    def finish(self) -> None:
        self.finished += 1


class FailingAt(Recording):
    """A tracker whose library raises from the given phase and step on (a disk, a server gone)."""

    name = "failing"

    def __init__(self, phase: str, step: int = 0) -> None:
        super().__init__()
        self.phase, self.step = phase, step

    def start(self, *args: Any) -> None:
        if self.phase == "start":
            raise OSError("store unreachable")
        super().start(*args)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.phase == "log" and step >= self.step:
            raise RuntimeError(f"write failed at {step}")
        super().log(step, metrics)


def _cfg(tmp_path: Path, **run: Any) -> Any:
    return parse_config({"run": {"dir": str(tmp_path / "run"), "name": "t", **run}})


ROWS = [{"step": s, "time": 1e9 + s, "reward_mean": s / 3, "version": s, "note": "x"} for s in (1, 2, 3)]


def test_a_tracker_that_raises_mid_run_is_disabled_logged_once_and_the_others_keep_every_row(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good, bad = Recording(), FailingAt("log", step=2)
    trackers = Trackers(_cfg(tmp_path), run_id="abc", backends=[good, bad])
    trackers.start(first_step=1)
    with caplog.at_level(logging.WARNING, logger="rlfleet.trackers"):
        for row in ROWS:
            trackers.log_row(row)
    trackers.finish()
    assert [s for s, _ in good.rows] == [1, 2, 3] and good.finished == 1
    assert [s for s, _ in bad.rows] == [1] and bad.finished == 1  # released once when disabled
    assert trackers.failures == 1
    assert len(caplog.records) == 1 and "failing disabled" in caplog.records[0].getMessage()
    assert "reward" not in caplog.records[0].getMessage()  # no payload in the line
    state = read_state(tmp_path / "run")
    assert state["disabled"]["failing"] == {"phase": "log", "step": 2, "error": "RuntimeError: write failed at 2",
                                            "failures": 1}
    assert state["timing"]["recording"]["rows"] == 3
    line = next(x for x in summary_lines(tmp_path / "run") if x.startswith("failing"))
    assert "disabled at step 2" in line and "metrics.jsonl has every row" in line


def test_a_tracker_that_fails_to_start_is_disabled_and_the_others_start(tmp_path: Path) -> None:
    good, bad = Recording(), FailingAt("start")
    trackers = Trackers(_cfg(tmp_path, max_steps=7), run_id="abc", backends=[bad, good])
    trackers.start(first_step=1)
    trackers.log_row(ROWS[0])
    assert good.started is not None and good.started[1]["run"]["max_steps"] == 7 and good.started[2] == "abc"
    assert good.rows == [(1, {"reward_mean": 1 / 3, "version": 1.0})]
    assert bad.rows == [] and read_state(tmp_path / "run")["disabled"]["failing"]["phase"] == "start"


def test_rows_before_start_wait_for_it_and_move_the_first_step(tmp_path: Path) -> None:
    # A recovering controller may finish a journaled step before its trackers start.
    good = Recording()
    trackers = Trackers(_cfg(tmp_path), run_id="abc", backends=[good])
    trackers.log_row(ROWS[1])
    assert good.rows == []
    trackers.start(first_step=3)
    assert good.started is not None and good.started[3] == 2
    assert [s for s, _ in good.rows] == [2]


def test_row_metrics_are_the_numbers_of_a_row_but_step_and_time() -> None:
    row = {"step": 4, "time": 1e9, "kl": 0.5, "tokens": 12, "reward/correct": 1.0, "flag": True, "mode": "greedy"}
    assert row_metrics(row) == {"kl": 0.5, "tokens": 12.0, "reward/correct": 1.0}


def test_the_config_is_logged_flat_and_without_credentials(tmp_path: Path) -> None:
    good = Recording()
    cfg = parse_config({"run": {"dir": str(tmp_path)}, "redis": {"url": "redis://:hunter2@10.0.0.1:6379/0"}})
    trackers = Trackers(cfg, run_id="abc", backends=[good])
    trackers.start()
    assert good.started is not None
    params = dict(flat_params(good.started[1]))
    assert "hunter2" not in str(params) and params["redis.url"].startswith("redis://:***@")
    assert params["algo.name"] == "grpo" and params["generation.stop_token_ids"] == "[]"
    assert all(isinstance(v, bool | int | float | str) for v in params.values())


def test_unknown_tracker_kind_is_rejected_with_the_kinds_allowed() -> None:
    with pytest.raises(ConfigError, match=r"run\.trackers\.0: 'kind': got 'comet'; allowed values: 'tensorboard',"
                                          r" 'wandb', 'mlflow'"):
        parse_config({"run": {"trackers": [{"kind": "comet"}]}})
    with pytest.raises(ConfigError, match=r"run\.trackers\.0: missing key 'kind'"):
        parse_config({"run": {"trackers": [{"dir": "tb"}]}})
    with pytest.raises(ConfigError, match=r"run\.trackers\.0\.wandb\.mode: got 'cloud'"):
        parse_config({"run": {"trackers": [{"kind": "wandb", "mode": "cloud"}]}})


def test_every_tracker_field_is_documented() -> None:
    for spec in (TensorBoardSpec, WandbSpec, MlflowSpec):
        for name, field in spec.model_fields.items():
            assert field.description, f"{spec.__name__}.{name} has no docstring"


def test_tracker_output_defaults_under_the_run_dir_and_relative_paths_are_pinned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    assert TensorBoardTracker(TensorBoardSpec(kind="tensorboard"), run_dir).dir == run_dir / "tensorboard"
    assert WandbTracker(WandbSpec(kind="wandb"), run_dir).dir == run_dir
    assert MlflowTracker(MlflowSpec(kind="mlflow"), run_dir, None).uri == f"file:{run_dir.resolve()}/mlruns"
    monkeypatch.chdir(tmp_path)
    cfg = parse_config({"run": {"trackers": [{"kind": "tensorboard", "dir": "tb"},
                                             {"kind": "mlflow", "tracking_uri": "file:ml"}]}})
    tb, ml = cfg.run.trackers
    assert isinstance(tb, TensorBoardSpec) and tb.dir == str(tmp_path / "tb")
    assert isinstance(ml, MlflowSpec) and ml.tracking_uri == f"file:{tmp_path / 'ml'}"


def test_a_tracker_whose_package_is_missing_is_a_one_line_error_naming_package_and_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` sees when it is not installed
    specs = parse_config({"run": {"trackers": [{"kind": "mlflow"}]}}).run.trackers
    with pytest.raises(ConfigError, match=r"mlflow needs the mlflow-skinny package.*pip install 'rlfleet\[track\]'"):
        check_trackers(specs)
    config = tmp_path / "c.yaml"
    text = EXAMPLE.read_text().replace("  eval_every: 50\n", "  eval_every: 50\n  trackers: [{kind: mlflow}]\n")
    config.write_text(text)
    assert main(["train", "--local", "--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "mlflow-skinny" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "models").exists()  # stopped before anything was built


def test_wandb_online_needs_an_api_key_and_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = parse_config({"run": {"trackers": [{"kind": "wandb", "mode": "online"}]}}).run.trackers
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("WANDB_API_KEY", raising=False)
        else:
            monkeypatch.setenv("WANDB_API_KEY", value)
        with pytest.raises(ConfigError, match=r"wandb with mode online needs WANDB_API_KEY"):
            check_trackers(specs)
    monkeypatch.setenv("WANDB_API_KEY", "k-0123456789abcdef")
    check_trackers(specs)  # set: accepted, and it appears in no config or state the run writes
    offline = parse_config({"run": {"trackers": [{"kind": "wandb"}]}}).run.trackers
    monkeypatch.delenv("WANDB_API_KEY")
    check_trackers(offline)  # offline needs no key


def test_the_same_tracker_kind_twice_is_rejected() -> None:
    specs = parse_config({"run": {"trackers": [{"kind": "tensorboard"}, {"kind": "tensorboard", "dir": "x"}]}})
    with pytest.raises(ConfigError, match="lists tensorboard twice"):
        check_trackers(specs.run.trackers)
