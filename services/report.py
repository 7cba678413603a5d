"""The run report: `RUN_DIR/report.html` with reward, KL, loss, throughput and queue-depth curves as
embedded PNG images, readable offline and attachable to an issue."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: reports are written on servers without a display
import matplotlib.pyplot as plt  # noqa: E402

PANELS: list[tuple[str, list[str], str]] = [
    ("Reward", ["reward_mean", "eval_reward"], "mean reward"),
    ("KL to reference", ["kl"], "nats/token"),
    ("Losses", ["policy_loss", "value_loss", "kl_loss"], "loss"),
    ("Throughput", ["tokens_per_s", "samples_per_s"], "per second"),
    ("Queue depth", ["queue_prompts", "queue_rollouts", "queue_scores"], "messages"),
    ("Step time", ["generate_s", "score_s", "train_s", "step_s"], "seconds"),
]


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


def write_report(run_dir: Path, title: str = "rlfleet run") -> Path:
    rows = read_metrics(run_dir / "metrics.jsonl")
    imgs = []
    for name, keys, ylabel in PANELS:
        b64 = _panel(rows, name, keys, ylabel)
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
        if "eval_reward_before" in first and "eval_reward" in last:
            items["eval reward (before → after)"] = (
                f"{first['eval_reward_before']:.3f} → {last['eval_reward']:.3f}"
            )
        summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                          for k, v in items.items())
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}figure{{display:inline-block;margin:.5em}}
th{{text-align:left;padding-right:1em}}</style></head><body>
<h1>{html.escape(title)}</h1><table>{summary}</table>{''.join(imgs) or '<p>no steps recorded</p>'}
</body></html>"""
    out = run_dir / "report.html"
    out.write_text(doc)
    return out
