"""The targets issue 16 sets (the ratio to TRL with vLLM, the repeats' spread, GPU utilization, time to
first step against TRL's), each met or missed from a run, and what holds a miss back."""

from __future__ import annotations

from typing import Any

from bench.vs_trl.cells import first_step_cell, num
from bench.vs_trl.figures import median_of, workload_summary

TARGET_RATIO = {"0.5b": 2.0, "1.5b": 1.6}
TARGET_SPREAD, TARGET_UTIL, TARGET_TTFS_GAP = 0.10, 85.0, 30.0


def first_step_gap(s: dict[str, Any]) -> tuple[float | None, str]:
    """rlfleet's time to first step minus TRL's, like with like: the repeats whose vLLM compiled from cold
    (or loaded from its cache) against TRL's runs that did the same, where the run says so, else the
    medians; where both states were measured on both sides, the larger of the two gaps."""
    peers, reps = [p for p in s.get("peers") or [s["peer"]] if p.get("first_step_s")], s["repeats"]
    if not peers or not reps:
        return None, ""
    how = {"cold": "vLLM compiling", "cached": "vLLM's compile cache warm"}
    pairs = []
    for state in how:
        mine = [p for p in reps if p.get("vllm_compile") == state]
        theirs = [p for p in peers if p.get("vllm_compile") == state]
        if mine and theirs:
            pairs.append((state, mine, theirs))
    if not pairs:  # a run that did not record compile states: the medians
        pairs = [("", reps, peers)]
    gaps = []
    for state, mine, theirs in pairs:
        a, b = median_of([p.get("first_step_s") for p in mine]), median_of([p.get("first_step_s") for p in theirs])
        if a is None or b is None:
            continue
        engine = median_of([p.get("engine_start_s") for p in mine])
        n = "the repeat" if len(mine) == 1 else f"median of the {len(mine)} repeats"
        m = "its run" if len(theirs) == 1 else f"median of its {len(theirs)} runs"
        said = f" with {how[state]}" if state else ""
        gaps.append((a - b,
                     f"rlfleet {a:.0f} s ({n}{said}; its vLLM engine process {num(engine, 0)} s of it), "
                     f"TRL {b:.0f} s ({m}{said})"))
    if not gaps:
        return None, ""
    gap = max(gaps)[0]
    why = "; ".join(w for _, w in gaps)
    if len(reps) > 1:
        why += "; every repeat: " + ", ".join(first_step_cell(p) for p in reps)
    if len(peers) > 1:
        why += "; every TRL run: " + ", ".join(first_step_cell(p) for p in peers)
    return gap, why


def _holding(s: dict[str, Any]) -> str:
    st = {k: v for k, v in (s.get("stages") or {}).items() if v}
    if not st:
        return "no stage timings"
    k = max(st, key=lambda x: st[x])
    return f"the largest stage is {k} at {st[k]:.2f} s of the {s['step_s']:.2f} s step"


def targets(res: dict[str, Any]) -> list[str]:
    out = []

    def line(what: str, value: float | None, goal: float, fmt: str, higher: bool, why: str = "",
             how: str = "") -> None:
        """`why` is said when the target is missed, `how` (what was compared) either way."""
        if value is None:
            out.append(f"- {what}: not measured")
            return
        met = value >= goal if higher else value <= goal
        said = [x for x in (how, "" if met else why) if x]
        out.append(f"- {what}: {fmt.format(value)} (target {fmt.format(goal)}): **{'met' if met else 'missed'}**"
                   + "".join(f"; {x}" for x in said))

    for w, goal in TARGET_RATIO.items():
        s = workload_summary(res, w)
        peer = s["peer"]
        why = ""
        if s.get("ratio") is not None:
            need = res["workload"]["prompts_per_step"] * res["workload"]["group"] / (goal * peer["samples_per_s"])
            why = (f"the step must drop from {s['step_s']:.2f} s to {need:.2f} s ({s['step_s'] - need:.2f} s); "
                   + _holding(s))
        how = ""
        if len(s["peers"]) > 1 and s.get("ratio") is not None:
            how = (f"against TRL's fastest of {len(s['peers'])} runs ({peer['samples_per_s']:.1f} samples/s;"
                   " runs " + ", ".join(f"{p['samples_per_s']:.1f}" for p in s["peers"])
                   + f"); against the median of its runs {s['ratio_median']:.2f}×")
        line(f"{w}: rlfleet GRPO over TRL with vLLM, samples/s", s.get("ratio"), goal, "{:.2f}×", True, why, how)
        reps = s["repeats"]
        line(f"{w}: spread of the {len(reps)} repeats ((max − min) / median)", s.get("spread"), TARGET_SPREAD,
             "{:.0%}", False, "samples/s " + ", ".join(f"{p['samples_per_s']:.1f}" for p in reps))
        line(f"{w}: steady GPU utilization (median of the repeats)", s.get("gpu_util"), TARGET_UTIL, "{:.1f}%", True,
             _holding(s) if s.get("step_s") else "")
        gap, why = first_step_gap(s)
        line(f"{w}: time to first step, rlfleet minus TRL with vLLM", gap, TARGET_TTFS_GAP, "{:.0f} s", False,
             how=why)
    return out
