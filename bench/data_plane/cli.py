"""`python -m bench.data_plane`'s arguments, and the command itself."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from bench.data_plane.config import QUICK, ROOT, BenchConfig
from bench.data_plane.report import format_report
from bench.data_plane.run import run_benchmark


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, Path, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m bench.data_plane",
                                 description="CPU benchmark of the rlfleet data plane against raw redis-py")
    ap.add_argument("--quick", action="store_true",
                    help="10 batches, fewer tiny hops, 2 local steps (< 15 s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default: bench/results/data_plane-<UTC stamp>[-quick].json)")
    ap.add_argument("--batches", type=int, help="measured batches per path and mode")
    ap.add_argument("--in-flight", type=int, help="batches in flight in the throughput mode")
    ap.add_argument("--rounds", type=int, help="throughput passes per path (the paths take turns)")
    ap.add_argument("--seqs", type=int, help="sequences per RolloutBatch")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--response-len", type=int)
    ap.add_argument("--tiny-hops", type=int, help="measured hops of each tiny-run message kind")
    ap.add_argument("--no-local", action="store_true", help="skip the local-loop step time")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for the host's CPUs to be < 10%% busy (shared hosts)")
    ap.add_argument("--local-steps", type=int)
    ap.add_argument("--local-timeout", type=float, help="seconds allowed for the local loop")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else BenchConfig()
    overrides = {
        "batches": args.batches, "in_flight": args.in_flight, "rounds": args.rounds, "seqs": args.seqs,
        "prompt_len": args.prompt_len, "response_len": args.response_len, "tiny_hops": args.tiny_hops,
        "local_steps": args.local_steps, "local_timeout_s": args.local_timeout,
    }
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.no_local:
        cfg = replace(cfg, local_loop=False)
    positive = ("batches", "in_flight", "rounds", "seqs", "prompt_len", "response_len", "tiny_hops",
                "local_steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    out = args.out
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = ROOT / "bench" / "results" / f"data_plane-{stamp}{'-quick' if args.quick else ''}.json"
    return cfg, out, args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out, args = parse_args(argv)
    res = run_benchmark(cfg, out, quick=bool(args.quick), wait_quiet_s=float(args.wait_quiet))
    print(format_report(res))
    print(f"results: {out}")
    return 0
