"""A fleet phase: `rlfleet up` on the phase's config, its stage histograms scraped at the first and the
last measured step, stopped as soon as that step is in, and its steady-state figures."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import read_rows
from bench.vs_trl.caches import phase_env
from bench.vs_trl.config import effective, fleet_config
from bench.vs_trl.gpu import GpuSampler, mean_util
from bench.vs_trl.logs import engine_start_s, scrape_stages, startup_timeline, step_compiles
from bench.vs_trl.phases import Phase
from bench.vs_trl.procs import kill_group, stop_fleet, tail
from bench.vs_trl.workload import REPO, WORK, W, model_dir, say


def phase_fleet(p: Phase, cap: float, gpu: GpuSampler, port_base: int) -> dict[str, Any]:
    cfg = fleet_config(p, model_dir(p.workload), port_base)
    run_dir = Path(cfg["run"]["dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg_path = WORK / f"{p.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = WORK / f"{p.name}.log"
    cmd = [sys.executable, "-m", "services.cli", "up", "--config", str(cfg_path), "--ready-timeout", str(int(cap))]
    say("$", " ".join(cmd), f"(cap {cap:.0f} s, log {log})")
    t0 = time.time()
    snaps: dict[int, tuple[float, dict[str, float]]] = {}
    first, last = W["warmup"], W["warmup"] + W["steps"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=phase_env(p),
                                start_new_session=True)
        deadline = time.monotonic() + cap
        stopped = False
        while proc.poll() is None and time.monotonic() < deadline:
            rows = read_rows(run_dir / "metrics.jsonl")
            done = max((int(r["step"]) for r in rows), default=0)
            for k in (first, last):
                if done >= k and k not in snaps:
                    snaps[k] = (time.time(), scrape_stages(cfg))
            if last in snaps:
                # Everything measured is in: the final checkpoint and export would only cost device time.
                stopped = stop_fleet(proc)
                break
            time.sleep(0.2)
        rc = proc.poll()
        if rc is None:
            kill_group(proc)
            rc = 124
    released_s = gpu.wait_released() if stopped else 0.0
    res: dict[str, Any] = {"rc": 0 if stopped else rc, "t0": t0, "t1": time.time(), "log_tail": tail(log),
                           "config": cfg, "effective": effective(cfg), "stopped_after_measuring": stopped,
                           "gpu_released_s": round(released_s, 1)}
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if "step_s" in r]
    res["rows"] = rows
    res["engine_start_s"] = engine_start_s(run_dir)
    res["startup"] = startup_timeline(run_dir, t0)
    res["step_compiles"] = step_compiles(run_dir)
    steady = [r for r in rows if first < int(r["step"]) <= last]
    if rows and int(rows[0]["step"]) == 1:
        res["first_step_s"] = float(rows[0]["time"]) - t0
    if len(steady) < max(2, W["steps"] // 2):
        res["error"] = f"only {len(steady)} steady steps recorded"
        return res
    step_s = statistics.median(float(r["step_s"]) for r in steady)
    w0 = next((float(r["time"]) for r in rows if int(r["step"]) == first),
              float(steady[0]["time"]) - float(steady[0]["step_s"]))
    w1 = float(steady[-1]["time"])
    stages: dict[str, float] = {"advantage": statistics.median(float(r.get("advantage_s", 0.0)) for r in steady)}
    if first in snaps and last in snaps:
        a, b = snaps[first][1], snaps[last][1]
        for k in b:
            stages[k] = (b[k] - a.get(k, 0.0)) / (last - first)
    tokens = statistics.median(int(r["tokens"]) for r in steady)
    gen_s = stages.get("generate")
    res.update(ok=True, window=(w0, w1), steps_measured=len(steady), median_step_s=step_s,
               samples_per_s=statistics.median(int(r["samples"]) for r in steady) / step_s,
               tokens_per_s=tokens / step_s,
               train_s=statistics.median(float(r.get("train_s", 0.0)) for r in steady),
               off_policy=statistics.fmean(float(r.get("off_policy", 0.0)) for r in steady),
               # Steps whose trainer ran the separate proximal pass (runs before 2026-12-02 08:30 did
               # on every off-policy step and logged only off_policy).
               proximal=statistics.fmean(float(r.get("proximal_forward", r.get("off_policy", 0.0)))
                                         for r in steady),
               response_len=statistics.median(float(r.get("response_len_mean", W["completion_tokens"]))
                                              for r in steady),
               stages=stages, generate_tokens_per_s=(tokens / gen_s) if gen_s else None,
               gpu_util=mean_util(gpu.between(w0, w1)),
               # Steps in which the trainer compiled graphs (algo.compile), step -> graphs: seconds a
               # measured step spends compiling are a warm-up gap, not the trainer's speed.
               compiled_in_steps={int(r["step"]): int(r["compiles"]) for r in rows if r.get("compiles")})
    return res
