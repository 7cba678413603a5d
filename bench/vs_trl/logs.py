"""What a phase's processes leave to read: the services' stage histograms (/metrics), TRL's own timers,
and the services' JSON logs (engine start, steps that compiled, the start-up timeline)."""

from __future__ import annotations

import json
import re
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def trl_stages(steps: list[dict[str, Any]]) -> dict[str, float]:
    """TRL's own profiling timers per step (median), mapped onto our stage names where they match."""
    per: dict[str, list[float]] = {}
    for s in steps:
        for k, v in (s.get("profile") or {}).items():
            if isinstance(v, int | float):
                per.setdefault(k, []).append(float(v))
    return {k: statistics.median(v) for k, v in per.items() if v}


def scrape_stages(cfg: dict[str, Any]) -> dict[str, float]:
    """Sum of rlfleet_stage_latency_seconds per stage over every running service."""
    import httpx

    out: dict[str, float] = {}
    for ep in cfg["services"].values():
        try:
            text = httpx.get(f"http://127.0.0.1:{ep['http_port']}/metrics", timeout=5).text
        except Exception:
            continue
        for line in text.splitlines():
            m = re.match(r'^rlfleet_stage_latency_seconds_sum\{([^}]*)\} ([-+0-9.eE]+)$', line)
            if m:
                stage = re.search(r'stage="([^"]+)"', m.group(1))
                if stage:
                    out[stage.group(1)] = out.get(stage.group(1), 0.0) + float(m.group(2))
    return out


def engine_start_s(run_dir: Path) -> float | None:
    """Seconds the actor's engine took to come up: its process's (`engine process started`), else vLLM's
    own line (`vLLM engine: ... started in 42.0s`) of an engine in the actor's process."""
    logs = sorted((run_dir / "logs").glob("actor*.log")) if (run_dir / "logs").is_dir() else []
    started = engine_process_s([r for log in logs for r in _records(log)])
    if started is not None:
        return started
    for log in logs:
        m = re.search(r"vLLM engine: .* started in ([0-9.]+)s", log.read_text(errors="replace"))
        if m:
            return float(m.group(1))
    return None


def engine_process_s(records: list[dict[str, Any]]) -> float | None:
    """Seconds the actor's engine process took to start (`engine process started`); with engine
    replicas, which start together and log one line each, the last one's."""
    started = [float(r["seconds"]) for r in records
               if r.get("msg") == "engine process started" and isinstance(r.get("seconds"), int | float)]
    return max(started) if started else None


def step_compiles(run_dir: Path) -> list[dict[str, Any]]:
    """Every `compiled during a step` record of the services (role, graphs, seconds and the guards that
    failed): which shapes or inputs the compile warm-up missed, read from the run itself."""
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    keep = ("role", "graphs", "seconds", "guard_failures")
    return [{k: r[k] for k in keep if k in r} for log in logs for r in _records(log)
            if r.get("msg") == "compiled during a step"]


def _records(log: Path) -> list[dict[str, Any]]:
    """A service log's JSON records (vLLM's and other libraries' plain lines are skipped)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _ts(rec: dict[str, Any]) -> float | None:
    try:
        return datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def startup_timeline(run_dir: Path, t0: float) -> dict[str, dict[str, float]]:
    """Where the time to first step goes: per service, seconds from the phase's launch to its first log
    record (its imports done) and to its `ready` state; the actor also gets its engine's start seconds,
    and the launcher (`launcher.log`) when it started the services and saw them all ready."""
    out: dict[str, dict[str, float]] = {}
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        recs = [(t, r) for r in _records(log) if (t := _ts(r)) is not None]
        if not recs:
            continue
        row = {"first_log_s": round(recs[0][0] - t0, 1)}
        ready = next((t for t, r in recs if r.get("msg") == "state changed" and r.get("to") == "ready"), None)
        if ready is not None:
            row["ready_s"] = round(ready - t0, 1)
        eng = engine_process_s([r for _, r in recs])
        if eng is not None:
            row["engine_s"] = eng
        # The actor's trainer, built and compiled while its engine starts.
        trainer = next((r.get("seconds") for _, r in recs if r.get("msg") == "trainer built while the engine starts"),
                       None)
        if isinstance(trainer, int | float):
            row["trainer_s"] = float(trainer)
        # The controller retries the trainables' GetState until they answer: the last failure is when
        # it could first reach them (on 2026-12-02, gRPC's reconnect backoff: 25-61 s after the actor
        # was ready).
        retried = [t for t, r in recs if r.get("msg") == "rpc failed, retrying"]
        if retried:
            row["last_rpc_retry_s"] = round(retried[-1] - t0, 1)
        # The launcher's own log: when it had passed preflight (its first record), started Redis and the
        # services, and saw them all ready.
        started = [t for t, r in recs if r.get("msg") == "service started"]
        if started:
            row["services_started_s"] = round(started[0] - t0, 1)
        ready_all = next((t for t, r in recs if r.get("msg") == "all services ready"), None)
        if ready_all is not None:
            row["ready_s"] = round(ready_all - t0, 1)
        out[log.stem] = row
    return out
