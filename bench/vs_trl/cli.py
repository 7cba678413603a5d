"""`python -m bench.vs_trl plan | run | report`: the arguments, and each command (see the package's
docstring)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import bench.vs_trl
from bench.vs_trl.caches import uses_vllm, vllm_compile_cache
from bench.vs_trl.gpu import GpuSampler
from bench.vs_trl.host import cpu_topology, host_snapshot, missing_modules, versions
from bench.vs_trl.phases import DEFAULT_GROUPS, print_plan, select
from bench.vs_trl.report import report
from bench.vs_trl.runners import run_phase
from bench.vs_trl.workload import DRY, REPO, SHAPES, WORK, W, build_model, say


def cmd_run(args: argparse.Namespace) -> int:
    if args.steps is not None:
        if args.steps < 2:
            print(f"vs_trl: --steps must be >= 2 (a median and a spread), got {args.steps}", file=sys.stderr)
            return 2
        W["steps"] = args.steps
    chosen = select(args.phases or args.only)
    print_plan(chosen, args.deadline_s)
    bad = missing_modules()
    if bad:
        print(f"vs_trl: cannot run, missing on this host: {'; '.join(bad)}", file=sys.stderr)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    gpu = GpuSampler()
    gpu.start()
    result: dict[str, Any] = {"command": " ".join(["python -m bench.vs_trl", *sys.argv[1:]]), "dry": DRY,
                              "gpu": gpu.name or "none", "versions": versions(), "workload": W,
                              "shapes": SHAPES, "cpu_topology": cpu_topology(),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": {},
                              "plan": {p.name: {"group": p.group, "est_s": p.est_s} for p in chosen}}
    for w in dict.fromkeys(p.workload for p in chosen):
        say(f"building the {w} model")
        build_model(w)
    gpu.mark_idle()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"vs_trl-{stamp}.json"
    for i, p in enumerate(chosen):
        left = args.deadline_s - (time.monotonic() - start)
        # A phase cut off at the deadline measures nothing and costs device time; a dry run's phases
        # take seconds, whatever the GPU estimates say.
        if left < (min(p.est_s, 60) if DRY else p.est_s):
            result["phases"][p.name] = {"skipped": f"{left:.0f} s left of the {args.deadline_s:.0f} s deadline"}
            continue
        say(f"phase {p.name} (estimate {p.est_s:.0f} s, {left:.0f} s left)")
        cached = vllm_compile_cache(p) if uses_vllm(p) else set()
        before = host_snapshot()
        try:
            result["phases"][p.name] = run_phase(p, min(max(p.est_s * 2.5, 60), left - 10), gpu,
                                                 result["phases"], i)
        except Exception as err:  # one broken phase must not cost the others
            result["phases"][p.name] = {"error": f"{type(err).__name__}: {err}"}
        ph = result["phases"][p.name]
        ph["host"] = {"before": before, "after": host_snapshot()}
        if uses_vllm(p):
            ph["vllm_compile"] = "cold" if vllm_compile_cache(p) - cached else "cached"
        ph["seconds"] = time.time() - float(ph.get("t0", time.time()))
        say(f"phase {p.name}: " + json.dumps({k: ph.get(k) for k in ("rc", "ok", "samples_per_s", "gpu_util",
                                                                      "first_step_s", "error", "reused_from")}))
        result["gpu_samples"] = gpu.samples
        path.write_text(json.dumps(result, default=str))  # after every phase: a cut-off run keeps what it has
    gpu.stop.set()
    result["gpu_samples"] = gpu.samples
    result["wall_s"] = time.monotonic() - start
    path.write_text(json.dumps(result, default=str))
    say(f"wrote {path} after {result['wall_s']:.0f} s")
    report([path], args.out, update_benchmarks=args.update_benchmarks)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=str(bench.vs_trl.__doc__).split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="print the phases, their groups and estimated seconds")
    pl.add_argument("--phases", default=None)
    r = sub.add_parser("run", help="run the chosen phases (GPU host), then write the report")
    r.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    r.add_argument("--deadline-s", type=float, default=570.0,
                   help="bound on the whole call; a phase that would start too late is skipped")
    r.add_argument("--phases", default=None,
                   help=f"comma-separated phases or groups (default: {','.join(DEFAULT_GROUPS)}; 'all')")
    r.add_argument("--steps", type=int, default=None,
                   help=f"measured steps per phase after the warm-up ones (default {W['steps']}); more cost device"
                        " time and narrow a median of steps whose times vary")
    r.add_argument("--only", default=None, help=argparse.SUPPRESS)  # the issue-7 spelling of --phases
    r.add_argument("--update-benchmarks", action="store_true", help="rewrite the section in BENCHMARKS.md")
    rep = sub.add_parser("report", help="merge results JSONs, render BENCHMARKS.md's section and the plots")
    rep.add_argument("--results", type=Path, nargs="+", required=True)
    rep.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    rep.add_argument("--update-benchmarks", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        print_plan(select(args.phases), float("inf"))
        return 0
    if args.cmd == "run":
        return cmd_run(args)
    report(args.results, args.out, args.update_benchmarks)
    return 0
