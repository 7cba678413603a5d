"""The host a run had: package versions, load and CPU clock around each phase, the CPUs and NUMA nodes
near the GPU, and whether every service and peer imports here at all (checked in seconds, first)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.vs_trl.config import PORTS
from bench.vs_trl.workload import DRY, REPO


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "trl", "vllm", "accelerate", "datasets"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:
            out[mod] = "absent"
    return out


def host_snapshot() -> dict[str, Any]:
    """What else the host was doing around a phase: load average, mean CPU clock and the processes with
    the highest CPU share over their lifetime (ps's %CPU). TRL with vLLM ran at 57.2 and 35.6 samples/s
    minutes apart on 2026-12-02, held on the CPU side in the slow run; this tells a busy or throttled
    host from a slow framework."""
    snap: dict[str, Any] = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        mhz = [float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines()
               if ln.startswith("cpu MHz")]
        snap["cpu_mhz"] = round(statistics.fmean(mhz)) if mhz else None
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,etimes,comm", "--sort=-pcpu", "--no-headers"],
                            capture_output=True, text=True, timeout=10).stdout
        snap["busiest"] = [" ".join(ln.split()) for ln in ps.splitlines()[:6]]
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return snap


def cpu_topology() -> dict[str, Any]:
    """Which CPUs the phases may run on, the host's NUMA nodes and the CPUs local to each NVIDIA GPU.
    TRL with vLLM, one process launching small kernels, varied by a third from run to run on a quiet
    host on 2026-12-02 (16:42 run); a process scheduled away from the GPU's node is one suspect."""
    def cpulist(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    gpus = [d for d in Path("/sys/bus/pci/devices").glob("*")
            if cpulist(d / "vendor") == "0x10de" and (cpulist(d / "class") or "").startswith("0x03")]
    return {"cpus_allowed": len(os.sched_getaffinity(0)),
            "numa_nodes": {n.name: cpulist(n / "cpulist") for n in nodes},
            "gpu_local_cpus": {d.name: cpulist(d / "local_cpulist") for d in sorted(gpus)}}


SERVICE_MODULES = tuple(f"services.{n}.server" for n in PORTS)
IMPORT_CHECK = r'''
import importlib, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except ImportError as e:
        print(f"{m}: {e}")
'''


def missing_modules(dry: bool = DRY) -> list[str]:
    """What the phases would die of at start-up, found in a few seconds instead of one phase at a time:
    every service's imports (a fresh GPU host lacks whatever its wheelhouse forgot), and vLLM and TRL."""
    mods = [*SERVICE_MODULES, "bench.trl_peer", *(() if dry else ("vllm", "trl"))]
    p = subprocess.run([sys.executable, "-c", IMPORT_CHECK, *mods], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    return [ln for ln in p.stdout.splitlines() if ln] or ([f"import check failed: {p.stderr.strip()[-300:]}"]
                                                           if p.returncode else [])
