"""`bench.vs_trl`'s report: merge the results of one or more calls, write the markdown section and a GPU
utilization plot per phase, and (asked to) put the section into BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.vs_trl.cells import num
from bench.vs_trl.figures import merge
from bench.vs_trl.render import MARK_BEGIN, MARK_END, render
from bench.vs_trl.workload import REPO


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    samples = res.get("gpu_samples") or []
    made = []
    for key, p in res["phases"].items():
        if "t0" not in p or p.get("reused_from"):  # a dry run's reused phase has its source's plot
            continue
        pts = [(t - p["t0"], u) for t, u, _ in samples if p["t0"] <= t <= p["t1"]]
        fig, ax = plt.subplots(figsize=(7, 2.6), dpi=80)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8)
        if p.get("window"):
            ax.axvspan(p["window"][0] - p["t0"], p["window"][1] - p["t0"], alpha=0.15, color="green",
                       label=f"steady: mean {num(p.get('gpu_util'))}%")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_xlabel("seconds since phase start")
        ax.set_ylabel("GPU util %")
        ax.set_title(f"{key} ({res['gpu']})", fontsize=9)
        fig.tight_layout()
        path = out / f"util-{key}.png"
        fig.savefig(path)
        plt.close(fig)
        made.append(path)
    return made


def report(paths: list[Path], out: Path, update_benchmarks: bool) -> None:
    res = merge(paths)
    out.mkdir(parents=True, exist_ok=True)
    md = render(res)
    (out / "vs_trl.md").write_text(md)
    made = plots(res, out)
    names = ", ".join(p.name for p in made) or "none (no matplotlib)"
    print(f"report: {out / 'vs_trl.md'}; plots: {names}", flush=True)
    if update_benchmarks:
        bm = REPO / "BENCHMARKS.md"
        text = bm.read_text()
        if MARK_BEGIN in text and MARK_END in text:
            text = text[: text.index(MARK_BEGIN)] + md + text[text.index(MARK_END) + len(MARK_END) + 1:]
        else:
            text = text.rstrip("\n") + "\n\n" + md
        bm.write_text(text)
    print(md)
