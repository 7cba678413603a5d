"""Experiment trackers (`run.trackers`): every metrics row the controller (or the local loop)
writes to RUN_DIR/metrics.jsonl also goes to TensorBoard, Weights & Biases and/or MLflow, with the
step as the x-axis and the same key names and float values; the run's resolved config is logged
once as hyper-parameters.

Failure model: metrics.jsonl stays the source of truth and is written first. A tracker that
raises (at start, on a row, at finish) is logged once, counted, disabled for the rest of the
process, and the run goes on; RUN_DIR/trackers.json records which tracker stopped, at which step
and why (report.html shows it), with the time the trackers took. A restarted controller tries
every tracker again. Calls are in line with the step loop: each writes a local file or hands the
row to W&B's own `wandb-core` process (measured on 2 loaded CPU cores: 3-17 ms a row per tracker,
the README's Tracking section has the figures).

`check_trackers` is the start-up check (`rlfleet up`, `train --local` and the controller
service): a tracker whose library is missing, or W&B online without WANDB_API_KEY, is a one-line
`ConfigError` before anything starts.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.core.config.run import ConfigError, RunConfig
from services.core.config.trackers import MlflowSpec, TensorBoardSpec, TrackerSpec, WandbSpec
from services.core.observability.logs import redact_text
from services.core.observability.tracker_backends import MlflowTracker, TensorBoardTracker, WandbTracker

__all__ = ["STATE_FILE", "Tracker", "Trackers", "check_trackers", "read_state", "row_metrics", "summary_lines"]

log = logging.getLogger("rlfleet.trackers")

STATE_FILE = "trackers.json"
# kind -> (the module its writer imports, the pip package that provides it)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
# Row keys that are not metrics: the x-axis itself, and the wall-clock stamp every tracker keeps anyway.
_NOT_METRICS = frozenset({"step", "time"})


class Tracker(Protocol):
    """What a tracker backend does; `services.core.observability.tracker_backends` has the three."""

    name: str

    def start(self, run_name: str, config: dict[str, Any], run_id: str, first_step: int) -> None:
        """Open (or, with `first_step` > 1, continue) the run and log `config` as hyper-parameters."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One metrics row at `step`."""

    def finish(self) -> None:
        """Close the run; it must be safe after a failed start."""


def check_trackers(specs: Sequence[TrackerSpec]) -> None:
    """Fail at start-up, with one line, on a tracker that cannot work. Imports nothing."""
    seen: set[str] = set()
    for spec in specs:
        if spec.kind in seen:
            raise ConfigError(f"run.trackers lists {spec.kind} twice: keep one entry per kind")
        seen.add(spec.kind)
        module, package = PACKAGES[spec.kind]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"run.trackers: {spec.kind} needs the {package} package, which is not installed:"
                              f" pip install 'rlfleet[track]' (or remove the tracker)")
        if isinstance(spec, WandbSpec) and spec.mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise ConfigError("run.trackers: wandb with mode online needs WANDB_API_KEY, which is unset or empty;"
                              " export it, or use mode: offline")


def row_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl row a tracker logs: every numeric key but `step` and `time`."""
    return {k: float(v) for k, v in row.items()
            if k not in _NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool)}


def read_state(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/trackers.json ({} when absent or unreadable): run id, MLflow run id, disabled trackers, timing."""
    try:
        data = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Trackers:
    """Every configured tracker of one process, behind the failure model of the module docstring."""

    def __init__(self, cfg: RunConfig, run_id: str, backends: Sequence[Tracker] | None = None) -> None:
        """`backends`: trackers to use instead of the ones `cfg.run.trackers` names (tests)."""
        check_trackers(cfg.run.trackers)
        self.cfg, self.run_id, self.run_dir = cfg, run_id, cfg.run_dir
        state = read_state(self.run_dir)
        # Another run's state (a fresh local run, a new run directory's leftovers) continues nothing.
        self.state: dict[str, Any] = state if state.get("run_id") == run_id else {"run_id": run_id}
        self.active: list[Tracker] = list(backends) if backends is not None else [
            self._make(spec) for spec in cfg.run.trackers]
        # Seconds each tracker took per phase, and rows logged: what the step loop paid for it.
        self.timing: dict[str, dict[str, float]] = {
            t.name: {"start_s": 0.0, "log_s": 0.0, "rows": 0, "finish_s": 0.0} for t in self.active}
        self.failures = 0
        # Rows that arrive before `start` (a controller finishing a journaled step while it recovers)
        # wait for it, so no tracker sees a row before its run is open.
        self.started = False
        self.held: list[dict[str, Any]] = []

    def _make(self, spec: TrackerSpec) -> Tracker:
        if isinstance(spec, TensorBoardSpec):
            return TensorBoardTracker(spec, self.run_dir)
        if isinstance(spec, WandbSpec):
            return WandbTracker(spec, self.run_dir)
        assert isinstance(spec, MlflowSpec)
        return MlflowTracker(spec, self.run_dir, saved_run_id=self.state.get("mlflow_run_id"))

    def start(self, first_step: int = 1) -> None:
        """`first_step`: the step of the next row this process writes (1 for a new run)."""
        self.started = True
        if not self.active:
            return
        first_step = min([first_step, *(int(r["step"]) for r in self.held)])
        self.state["trackers"] = [t.name for t in self.active]
        config = _redacted(self.cfg.model_dump(mode="json"))
        for t in list(self.active):
            self._call(t, "start", first_step, t.start, self.cfg.run.name, config, self.run_id, first_step)
            if isinstance(t, MlflowTracker) and t.run_id is not None and t in self.active:
                self.state["mlflow_run_id"] = t.run_id
        self._save()
        held, self.held = self.held, []
        for row in held:
            self.log_row(row)

    def log_row(self, row: Mapping[str, Any]) -> None:
        if not self.active:
            return
        if not self.started:
            self.held.append(dict(row))
            return
        step, metrics = int(row["step"]), row_metrics(row)
        for t in list(self.active):
            self._call(t, "log", step, t.log, step, metrics)

    def finish(self) -> None:
        for t in list(self.active):
            self._call(t, "finish", None, t.finish)
        self.active = []
        if self.timing:  # summed over the processes of a resumed run
            before = self.state.get("timing", {})
            self.state["timing"] = {**before, **{
                name: {k: before.get(name, {}).get(k, 0) + v for k, v in t.items()} for name, t in self.timing.items()}}
            self._save()

    def _call(self, t: Tracker, phase: str, step: int | None, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as e:
            self._disable(t, phase, step, e)
        finally:
            timing = self.timing[t.name]
            timing[f"{phase}_s"] += time.perf_counter() - t0
            timing["rows"] += phase == "log"

    def _disable(self, t: Tracker, phase: str, step: int | None, err: Exception) -> None:
        self.active.remove(t)
        self.failures += 1
        error = redact_text(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")[:300]
        disabled = self.state.setdefault("disabled", {})
        disabled[t.name] = {"phase": phase, "step": step, "error": error,
                            "failures": int(disabled.get(t.name, {}).get("failures", 0)) + 1}
        log.warning("tracker %s disabled for the rest of the run (%s at step %s failed: %s); metrics.jsonl is"
                    " complete", t.name, phase, step, error,
                    extra={"tracker": t.name, "phase": phase, "step": step, "error": error})
        if phase != "finish":
            try:
                t.finish()  # release what it holds (a writer's file, W&B's process)
            except Exception:
                pass
        self._save()

    def _save(self) -> None:
        path = self.run_dir / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.state, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the state waits for the next save, the run goes on
            log.warning("trackers.json not written", extra={"error": e.strerror or type(e).__name__})


def summary_lines(run_dir: Path) -> list[str]:
    """One line per tracker of the run for report.html: what it logged and what it cost (counted
    by the processes that finished: a killed controller's share is in the trackers, not here), or
    when and why it was disabled."""
    state = read_state(run_dir)
    timing, disabled = state.get("timing", {}), state.get("disabled", {})
    out = []
    for name in state.get("trackers", []):
        t = timing.get(name, {})
        rows = int(t.get("rows", 0))
        line = f"{name}: {rows} rows logged"
        if rows:
            line += f", {1000 * t.get('log_s', 0.0) / rows:.1f} ms a row, started in {t.get('start_s', 0.0):.1f} s"
        if name in disabled:
            d = disabled[name]
            line += (f"; disabled at step {d.get('step')} ({d.get('phase')} failed: {d.get('error')}),"
                     " metrics.jsonl has every row")
        out.append(line)
    return out


def _redacted(value: Any) -> Any:
    """The config as hyper-parameters: never a credential (a redis URL with a password in it)."""
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
