"""The host and the server a run had: CPU time from /proc (busy, steal, ours and other processes'),
waiting for a quiet host, the CPU, packages and Redis settings."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import redis
import torch

from bench.data_plane.config import say


def cpu_times() -> dict[str, int] | None:
    """Aggregate CPU jiffies from /proc/stat (Linux), to report busy and steal time over the run."""
    try:
        with open("/proc/stat") as f:
            head = f.readline().split()
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    if not head or head[0] != "cpu":
        return None
    return {name: int(v) for name, v in zip(names, head[1:], strict=False)}


CpuSeconds = tuple[float, float]  # (user, system)


def process_cpu_s(pid: int | None = None) -> CpuSeconds | None:
    """CPU seconds (user, system; all threads) of this process or of `pid`, from /proc."""
    if pid is None:
        t = os.times()
        return t.user, t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, IndexError, ValueError):
        return None


def cpu_usage(
    before: dict[str, int] | None, after: dict[str, int] | None, own: CpuSeconds | None
) -> dict[str, float] | None:
    """Shares of all CPUs' time between two `cpu_times()`: `busy` (not idle/iowait), `kernel`
    (system + irq + softirq: loopback networking and AOF writeback, mostly ours), `steal` (time the
    hypervisor gave to other guests), `own` (this benchmark and its redis-server, or the local
    loop's child) and `others_user`: user time of other processes, i.e. other work competing for
    the CPUs while we measured (`others`: all busy time that is not `own`, kernel work included)."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in before}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = 1.0 - (d.get("idle", 0) + d.get("iowait", 0)) / total
    out = {
        "busy": busy,
        "kernel": (d.get("system", 0) + d.get("irq", 0) + d.get("softirq", 0)) / total,
        "steal": d.get("steal", 0) / total,
    }
    if own is not None:
        tick = os.sysconf("SC_CLK_TCK")
        out["own"] = (own[0] + own[1]) * tick / total
        out["others"] = max(0.0, busy - out["own"])
        out["others_user"] = max(0.0, (d.get("user", 0) + d.get("nice", 0)) / total - own[0] * tick / total)
    return out


def wait_for_quiet_host(max_wait_s: float, busy_below: float = 0.10, window_s: float = 2.0) -> float | None:
    """Wait (up to `max_wait_s`) until the host's CPUs are less than `busy_below` busy over a
    `window_s` window, so that other processes do not land in the measurement. Returns the busy
    share of the last window (None where /proc/stat is unavailable)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = cpu_times()
        time.sleep(window_s)
        usage = cpu_usage(before, cpu_times(), None)
        if usage is None:
            return None
        if usage["busy"] < busy_below or time.monotonic() >= deadline:
            return usage["busy"]
        say(f"host CPUs {usage['busy']:.0%} busy with other work; waiting for a quiet host")


def _fs_type(path: Path) -> str:
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_info() -> dict[str, Any]:
    from google.protobuf import __version__ as protobuf_version
    from google.protobuf.internal import api_implementation

    try:
        import hiredis  # type: ignore[import-not-found]

        hiredis_version: str | None = str(hiredis.__version__)
    except ImportError:
        hiredis_version = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "protobuf": protobuf_version,
        "protobuf_backend": api_implementation.Type(),
        "redis_py": redis.__version__,
        "hiredis": hiredis_version,
    }


def redis_info(client: redis.Redis, data_dir: Path) -> dict[str, Any]:
    server: Any = client.info("server")
    conf: Any = client.config_get("*")
    return {
        "version": server.get("redis_version"),
        "appendonly": conf.get("appendonly"),
        "appendfsync": conf.get("appendfsync"),
        "maxmemory_policy": conf.get("maxmemory-policy"),
        "bind": conf.get("bind"),
        "data_dir_fs": _fs_type(data_dir),
    }
