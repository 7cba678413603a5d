"""What a committed step leaves behind besides the journal: its metrics.jsonl row, the gauges
Prometheus scrapes, the queue depths `rlfleet status` shows, a `resources` event for the audit, and
the same row in the configured experiment trackers (`services.core.observability.trackers`, after the file).
After a crash, steps the journal committed but whose row was never written get a row saying so."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from services.core.journal.journal import Journal
from services.core.observability.events import AppendOnlyFile, EventLog
from services.core.observability.metrics import ServiceMetrics
from services.core.observability.trackers import Trackers
from services.core.transport.bus import Bus, BusUnavailable
from services.rl import batch as rb


class StepRecorder:
    def __init__(self, metrics_path: Path, metrics: ServiceMetrics, events: EventLog, journal: Journal,
                 trackers: Trackers | None = None) -> None:
        self.path, self.metrics, self.events, self.journal = metrics_path, metrics, events, journal
        self.trackers = trackers
        self.file = AppendOnlyFile(metrics_path, fsync=False)  # holds rows, in order, while the disk is full
        self.last: dict[str, Any] = {}  # headline numbers of the last step, for `rlfleet status`
        self.queues: dict[str, int] = {}  # stream depths at the last step
        self.t_last_step = time.perf_counter()
        self._unlogged: tuple[int, list[dict[str, Any]]] = (1, [])  # the trackers' first step, back-filled rows

    async def depths(self, bus: Bus) -> dict[str, int]:
        try:
            # Fully acknowledged entries are dropped so stream length tracks real backlog; trimming
            # never passes an entry some group still needs.
            for stream in (bus.keys.prompts, bus.keys.rollouts, bus.keys.scores):
                await bus.trim_acked(stream)
            depths = await bus.stream_depths()
        except BusUnavailable:
            return {}
        for k, v in depths.items():
            self.metrics.queue_depth.labels(stream=k, group="all").set(v)
        self.queues = depths
        return depths

    async def record(self, bus: Bus, *, step: int, version: int, r: rb.RolloutArrays, stats: dict[str, float],
                     staleness: int, times: dict[str, float], paused_s: float = 0.0) -> None:
        """`step` is the committed step (from 1); `times` holds advantage_s and train_s; `paused_s`
        is time since the last step that was not the step's (held-out evaluation)."""
        now = time.perf_counter()
        tokens = int(r.response_mask.sum())
        elapsed = max(now - self.t_last_step - paused_s, 1e-9)
        self.t_last_step = now
        depths = await self.depths(bus)
        if "reward_mean" not in stats and r.rewards is not None:
            stats["reward_mean"] = float(r.rewards.astype("float32").mean())
        row = {
            "step": step, "time": time.time(), "version": version, **stats, "tokens": tokens, "samples": len(r),
            "tokens_per_s": tokens / elapsed, "samples_per_s": len(r) / elapsed, **times,
            "step_s": elapsed, "staleness": staleness, **{f"queue_{k}": v for k, v in depths.items()},
        }
        self.file.append((json.dumps(row) + "\n").encode())
        if self.trackers is not None:
            self.trackers.log_row(row)
        self.last = {k: row[k] for k in ("step", "reward_mean", "tokens_per_s", "staleness", "kl", "dropped_groups",
                                         "admitted_prompts") if k in row}
        m = self.metrics
        m.policy_version.set(version)
        m.staleness.set(staleness)
        if "reward_mean" in stats:
            m.reward_mean.set(stats["reward_mean"])
        if "kl" in stats:
            m.kl.set(stats["kl"])
        m.loss.labels(kind="policy").set(stats.get("policy_loss", 0.0))
        m.samples.labels(phase="train").inc(len(r))
        m.tokens.labels(phase="train").inc(tokens)
        m.stage_latency.labels(stage="step").observe(elapsed)
        self.events.emit("resources", queue_depths=depths, rss_bytes=_rss_bytes(), disk_bytes=self.journal.usage())

    def close(self) -> None:
        self.file.close()
        if self.trackers is not None:
            self.trackers.finish()

    def backfill(self) -> None:
        """metrics.jsonl keeps one row per step: a step committed to the journal just before a
        crash, whose row was never written, gets a row saying so."""
        from services.report import read_metrics

        text = self.path.read_text() if self.path.exists() else ""
        last = max((int(r.get("step", 0)) for r in read_metrics(self.path)), default=0)
        rows = [{"step": step, "version": step, "recovered": 1.0} for step in range(last + 1, self.journal.step + 1)]
        self._unlogged = (last + 1, rows)
        with self.path.open("a") as f:
            if text and not text.endswith("\n"):
                f.write("\n")  # a row torn by the crash stays unreadable instead of gluing onto the next
            for row in rows:
                f.write(json.dumps(row) + "\n")

    async def start_trackers(self) -> None:
        """Once, after `backfill`: start the trackers at the first step this process writes (a
        resumed run continues their runs) and give them the back-filled rows. In a thread: importing
        and opening W&B or MLflow takes seconds, and the event loop keeps serving meanwhile."""
        if self.trackers is None:
            return
        first, rows = self._unlogged
        await asyncio.to_thread(self.trackers.start, first)
        for row in rows:
            self.trackers.log_row(row)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
