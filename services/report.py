"""The run report: `RUN_DIR/report.html` with reward, held-out evaluation, KL, loss, throughput and
queue-depth curves as embedded PNG images, the wall time, the audit's verdict on a finished run, a
table of sample completions per evaluation and the resolved config: readable offline and
attachable to an issue."""

from __future__ import annotations

import base64
import html
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: reports are written on servers without a display
import matplotlib.pyplot as plt  # noqa: E402

PANELS: list[tuple[str, list[str], str]] = [
    ("Reward", ["reward_mean", "eval_reward"], "mean reward"),
    ("Held-out evaluation", ["eval_reward", "eval_reward_greedy", "eval_accuracy", "eval_accuracy_greedy"],
     "reward / accuracy"),
    ("KL to reference", ["kl"], "nats/token"),
    ("Losses", ["policy_loss", "value_loss", "kl_loss"], "loss"),
    ("Throughput", ["tokens_per_s", "samples_per_s"], "per second"),
    ("Queue depth", ["queue_prompts", "queue_rollouts", "queue_scores"], "messages"),
    ("Step time", ["generate_s", "score_s", "train_s", "step_s"], "seconds"),
    ("Dynamic sampling", ["admitted_prompts", "dropped_groups", "surplus_groups"], "prompts / groups per step"),
]
EVAL_KEYS = ("eval_reward", "eval_reward_greedy", "eval_accuracy", "eval_accuracy_greedy")
CONFIG_FILES = ("fleet.yaml", "local.yaml")  # the resolved config of a fleet run / a local run
SAMPLES_PER_EVAL = 4  # per mode: the full set is in samples.jsonl


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a crash mid-write is skipped, never fatal
    return rows


def _panel(rows: list[dict[str, Any]], title: str, keys: list[str], ylabel: str) -> str | None:
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    drawn = False
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and r[key] == r[key]]
        if pts:
            xs, ys = zip(*pts, strict=True)
            noisy = len(pts) >= 40
            line = ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=key,
                           alpha=0.35 if noisy else 1.0)
            if noisy:
                # Per-step values of a sampled batch are noisy; the trend is what a reader wants.
                w = max(5, len(pts) // 15)
                smooth = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
                ax.plot(xs, smooth, color=line[0].get_color(), label=f"{key} ({w}-step mean)")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _with_before(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation before training (keys `*_before` on step 1's row) as a point at step 0."""
    if not rows:
        return rows
    before = {k: rows[0][f"{k}_before"] for k in EVAL_KEYS if f"{k}_before" in rows[0]}
    return [{"step": 0, **before}, *rows] if before else rows


def _esc(v: Any) -> str:
    return html.escape(str(v))


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else _esc(v)


def _config(run_dir: Path) -> tuple[str, str] | None:
    for name in CONFIG_FILES:
        try:
            return name, (run_dir / name).read_text(errors="replace")
        except OSError:
            continue
    return None


def _wall_time(run_dir: Path, rows: list[dict[str, Any]]) -> str | None:
    """From the resolved config being written (the run's start) to its last step's row."""
    times = [r["time"] for r in rows if isinstance(r.get("time"), int | float)]
    starts = []
    for name in CONFIG_FILES:
        try:
            starts.append((run_dir / name).stat().st_mtime)
        except OSError:
            continue
    if not times or not starts:
        return None
    secs = max(0.0, max(times) - min(starts))
    return time.strftime("%H:%M:%S", time.gmtime(secs)) + f" ({secs:.0f} s)"


def _audit_section(run_dir: Path) -> str:
    """The audit's verdict on a finished fleet run (a local run has no journal to audit)."""
    from services.audit import AuditError, audit

    if not (run_dir / "journal").exists():
        return "<p>audit: not applicable (no journal: a local run)</p>"
    try:
        rep = audit(run_dir)
    except AuditError as err:
        return f"<p>audit: could not run: {_esc(err)}</p>"
    if not rep.finished:
        return f"<p>audit: not run, the run has not finished ({_esc(rep.finished_reason)})</p>"
    verdict = "PASS" if rep.ok else "FAIL"
    items = "".join(
        f"<tr><td>{c.number}</td><td>{_esc(c.name)}</td><td>{'PASS' if c.passed else 'FAIL'}</td>"
        f"<td>{_esc(', '.join(f'{k}: {n}' for k, n in c.violations.items()) or '-')}</td></tr>"
        for c in rep.checks)
    return (f'<p class="audit">audit: <b>{verdict}</b> ({len(rep.checks)} invariants)</p>'
            f"<table><tr><th>#</th><th>invariant</th><th>result</th><th>violations</th></tr>{items}</table>")


def _samples_section(run_dir: Path) -> str:
    from services.tasks.evaluation import SAMPLES_FILE, read_samples

    rows = read_samples(run_dir / SAMPLES_FILE)
    if not rows:
        return "<p>no evaluation samples recorded</p>"
    shown: dict[tuple[Any, Any], int] = {}
    cells = []
    for r in rows:
        key = (r.get("step"), r.get("mode"))
        if shown.get(key, 0) >= SAMPLES_PER_EVAL:
            continue
        shown[key] = shown.get(key, 0) + 1
        cells.append("<tr>" + "".join(f"<td>{_fmt(r.get(k, ''))}</td>" for k in
                                      ("step", "version", "mode", "prompt", "completion", "answer", "reward"))
                     + "</tr>")
    head = "".join(f"<th>{k}</th>" for k in ("step", "version", "mode", "prompt", "completion", "answer", "reward"))
    return (f'<table class="samples"><tr>{head}</tr>{"".join(cells)}</table>'
            f"<p>{len(rows)} samples in {SAMPLES_FILE}; {SAMPLES_PER_EVAL} per evaluation and mode shown</p>")


def _trackers_section(run_dir: Path) -> str:
    from services.core.observability.trackers import summary_lines

    lines = summary_lines(run_dir)
    return "".join(f"<p>{_esc(line)}</p>" for line in lines) or "<p>no experiment trackers configured</p>"


def _section(title: str, render: Callable[[], str]) -> str:
    try:
        body = render()
    except Exception as err:  # a report is best effort: one broken part never loses the others
        body = f"<p>not available: {_esc(type(err).__name__)}: {_esc(err)}</p>"
    return f"<h2>{_esc(title)}</h2>{body}"


def write_report(run_dir: Path, title: str = "rlfleet run") -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    imgs = []
    for name, keys, ylabel in PANELS:
        b64 = _panel(_with_before(rows) if name == "Held-out evaluation" else rows, name, keys, ylabel)
        if b64:
            imgs.append(f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{b64}"></figure>')
    summary = ""
    if rows:
        first, last = rows[0], rows[-1]
        items = {
            "steps": last.get("step"),
            "reward (first step → last step)": f"{first.get('reward_mean', float('nan')):.3f} → "
            f"{last.get('reward_mean', float('nan')):.3f}",
            "median tokens/s": f"{sorted(r.get('tokens_per_s', 0) for r in rows)[len(rows) // 2]:.0f}",
        }
        wall = _wall_time(run_dir, rows)
        if wall:
            items["wall time"] = wall
        evals = [r for r in rows if "eval_reward" in r or "eval_reward_greedy" in r]
        for key in EVAL_KEYS:
            if f"{key}_before" in first and evals and key in evals[-1]:
                items[f"{key.replace('_', ' ')} (before → after)"] = (
                    f"{first[f'{key}_before']:.3f} → {evals[-1][key]:.3f}")
        summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                          for k, v in items.items())
    cfg = _config(run_dir)
    config = (f"<h2>Config ({_esc(cfg[0])})</h2><pre>{_esc(cfg[1])}</pre>" if cfg
              else "<h2>Config</h2><p>no resolved config in the run directory</p>")
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}figure{{display:inline-block;margin:.5em}}
th{{text-align:left;padding-right:1em}}td{{padding-right:1em;vertical-align:top}}
table.samples td{{font-family:monospace;white-space:pre-wrap;max-width:40em}}</style></head><body>
<h1>{html.escape(title)}</h1><table>{summary}</table>{''.join(imgs) or '<p>no steps recorded</p>'}
{_section("Audit", lambda: _audit_section(run_dir))}
{_section("Sample completions", lambda: _samples_section(run_dir))}
{_section("Experiment trackers", lambda: _trackers_section(run_dir))}
{config}
</body></html>"""
    out = run_dir / "report.html"
    out.write_text(doc)
    return out
