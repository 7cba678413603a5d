"""The tiny run's step time: the local loop for a few steps in a child process, with a time limit."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from bench.data_plane.config import ROOT, BenchConfig
from bench.data_plane.host import CpuSeconds, cpu_times, cpu_usage
from bench.data_plane.stats import median

_LOCAL_CHILD: Final = """
import sys
from services.core.config.run import load_config
from services.local import run_local
config, steps, run_dir = sys.argv[1:4]
print(run_local(load_config(config, run__max_steps=int(steps), run__dir=run_dir, task__eval_size=0)))
"""


def _children_cpu_s() -> CpuSeconds:
    """CPU seconds (user, system) of this process's waited-for children (the local loop's child,
    once it ended)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime, ru.ru_stime


def _skipped(reason: str, **extra: Any) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, **extra}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "(no output)"


def measure_local_step(cfg: BenchConfig) -> dict[str, Any]:
    """Run the tiny run's local loop for `local_steps` steps in a child process (bounded by
    `local_timeout_s`; evaluation off, it is not part of a step; the policy is built in the
    temporary run dir as a fresh run does) and read `step_s` from the metrics.jsonl it writes. The
    first `local_warmup_steps` steps pay one-off costs (lazy kernel set-up, first backward pass) and
    are kept in the samples but left out of the median."""
    if not cfg.local_loop:
        return _skipped("disabled (--no-local)")
    config = ROOT / cfg.tiny_config
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-local-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-c", _LOCAL_CHILD, str(config), str(cfg.local_steps), str(run_dir)]
        t0 = time.perf_counter()
        cpu0, child0 = cpu_times(), _children_cpu_s()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.local_timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            return _skipped(f"the local loop did not finish {cfg.local_steps} steps within "
                            f"{cfg.local_timeout_s:g} s (raise --local-timeout)")
        wall = time.perf_counter() - t0
        child1 = _children_cpu_s()
        cpu = cpu_usage(cpu0, cpu_times(), (child1[0] - child0[0], child1[1] - child0[1]))
        if proc.returncode != 0:
            return _skipped(f"the local loop failed (exit {proc.returncode}): {_last_line(proc.stderr)}")
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            return _skipped(f"the local loop wrote no {metrics.name}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return _skipped("the local loop's metrics.jsonl is empty")
    skip = cfg.local_warmup_steps if len(rows) > cfg.local_warmup_steps else 0
    cols = {k: [float(r[k]) for r in rows if k in r] for k in ("step_s", "generate_s", "score_s", "train_s")}
    return {
        "status": "ok",
        "config": cfg.tiny_config,
        "steps": len(rows),
        "warmup_steps_excluded": skip,
        "wall_s": wall,
        "cpu": cpu,
        **{f"{k}_p50": median(v[skip:]) for k, v in cols.items()},
        **{f"{k}_samples": v for k, v in cols.items()},
        "note": "wall_s includes the child's imports and the model build; step_s is the loop's own timing"
                " (generate + score + train + weight sync of one step); medians leave out the warm-up steps",
    }
