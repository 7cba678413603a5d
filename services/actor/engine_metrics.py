"""Per-replica engine figures for the actor's /metrics and `rlfleet status` (generation.replicas > 1).

Read at scrape time from the `ReplicaEngine`'s counters, so nothing polls. Every sample carries a
`replica` label; GPU figures carry the `gpu` label too (the host's NVML index, as `rlfleet plan`
prints it) and exist only where NVML sees the replica's GPU: on the CPU they are absent, not zero.

    rlfleet_engine_replica_tokens_total{replica}             tokens generated (rate() -> tokens/s)
    rlfleet_engine_replica_generate_seconds_total{replica}   wall time spent generating
    rlfleet_engine_replica_alive{replica}                    1 while its process lives
    rlfleet_engine_replica_version{replica}                  policy version it serves
    rlfleet_engine_replica_memory_bytes{replica,kind="rss"}  its process's resident memory (Linux)
    rlfleet_engine_replica_gpu_memory_bytes{replica,gpu}     GPU memory its process holds (NVML)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.core.observability.gpu import GpuMonitor
from services.models.engines.replicas import ReplicaEngine

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid` from /proc (None where there is no /proc or the process is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def replica_rows(engine: ReplicaEngine, gpu: GpuMonitor | None) -> list[dict[str, Any]]:
    """`replica_stats()` plus tokens/s, resident memory and, where NVML sees them, the GPUs with the
    memory the replica's process holds on each."""
    visible = gpu.visible() if gpu is not None and gpu.available else []
    rows = []
    for row in engine.replica_stats():
        secs = row["generate_seconds"]
        row["tokens_per_s"] = round(row["tokens"] / secs, 1) if secs > 0 else 0.0
        pid = row.get("pid")
        if pid:
            rss = rss_bytes(pid)
            if rss is not None:
                row["memory_bytes"] = rss
        gpus = []
        for pos in row.get("ordinals", []):
            if gpu is not None and pos < len(visible):
                entry: dict[str, Any] = {"gpu": visible[pos][0]}
                used = gpu.process_memory(pos, pid) if pid else None
                if used is not None:
                    entry["memory_bytes"] = used
                gpus.append(entry)
        if gpus:
            row["gpus"] = gpus
        rows.append(row)
    return rows


class ReplicaCollector(Collector):
    def __init__(self, engine: ReplicaEngine, gpu: GpuMonitor | None) -> None:
        self.engine = engine
        self.gpu = gpu

    def collect(self) -> Iterable[Metric]:
        rows = replica_rows(self.engine, self.gpu)
        tokens = CounterMetricFamily("rlfleet_engine_replica_tokens", "Tokens generated per engine replica",
                                     labels=["replica"])
        secs = CounterMetricFamily("rlfleet_engine_replica_generate_seconds",
                                   "Seconds spent generating per engine replica", labels=["replica"])
        alive = GaugeMetricFamily("rlfleet_engine_replica_alive", "1 while the replica's process lives",
                                  labels=["replica"])
        version = GaugeMetricFamily("rlfleet_engine_replica_version", "Policy version the replica serves",
                                    labels=["replica"])
        mem = GaugeMetricFamily("rlfleet_engine_replica_memory_bytes", "Resident memory of the replica's process",
                                labels=["replica", "kind"])
        gmem = GaugeMetricFamily("rlfleet_engine_replica_gpu_memory_bytes",
                                 "GPU memory the replica's process holds, per GPU", labels=["replica", "gpu"])
        for row in rows:
            r = str(row["replica"])
            tokens.add_metric([r], row["tokens"])
            secs.add_metric([r], row["generate_seconds"])
            alive.add_metric([r], int(row["alive"]))
            version.add_metric([r], row["version"])
            if "memory_bytes" in row:
                mem.add_metric([r, "rss"], row["memory_bytes"])
            for g in row.get("gpus", []):
                if "memory_bytes" in g:
                    gmem.add_metric([r, str(g["gpu"])], g["memory_bytes"])
        yield from (tokens, secs, alive, version, mem, gmem)
