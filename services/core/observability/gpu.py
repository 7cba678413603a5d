"""GPU utilization and memory into a service's metrics, via NVML, only where a GPU exists.

`nvidia-ml-py` (module `pynvml`) is an optional dependency (`pip install rlfleet[gpu]`). Without it,
without a driver, or without a device, the monitor reports no GPU and every call is a no-op: CPU-only
services and CI machines run the same code.

Only the GPUs this process may use are reported: NVML sees every device on the host, so the monitor
follows `CUDA_VISIBLE_DEVICES` (indices or UUIDs, as `rlfleet plan` writes them). The `gpu` label
is the host's NVML index, the same number `rlfleet plan` prints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from services.core.observability.metrics import ServiceMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization: float  # 0-1
    memory_used_bytes: int
    memory_total_bytes: int


def _import_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _visible_filter(env: str | None) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES entries, or None when unset (all devices visible)."""
    if env is None:
        return None
    return [d.strip() for d in env.split(",") if d.strip()]


class GpuMonitor:
    """Samples NVML on demand (the runtime calls `update()` on each /metrics scrape)."""

    def __init__(self, metrics: ServiceMetrics, nvml: ModuleType | bool | None = True) -> None:
        # `nvml` is the pynvml module; True imports it; None/False means "no NVML" (tests pass fakes).
        self.metrics = metrics
        self._nvml: Any = _import_nvml() if nvml is True else (nvml or None)
        self._handles: list[tuple[int, Any]] = []
        # NVML calls are not documented as thread-safe per handle; scrapes may overlap.
        self._lock = threading.Lock()
        self.reason: str | None = None
        self._initialised = False
        if self._nvml is None:
            self.reason = "nvidia-ml-py not installed"
            return
        try:
            self._nvml.nvmlInit()
            self._initialised = True
            self._handles = self._visible_handles()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / NoPermission ...
            self.reason = f"NVML unavailable: {type(e).__name__}"
            self._handles = []
            return
        if not self._handles:
            self.reason = "no visible GPU"

    def _visible_handles(self) -> list[tuple[int, Any]]:
        n = int(self._nvml.nvmlDeviceGetCount())
        handles = [(i, self._nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
        wanted = _visible_filter(os.environ.get("CUDA_VISIBLE_DEVICES"))
        if wanted is None:
            return handles
        out: list[tuple[int, Any]] = []
        for entry in wanted:
            for i, h in handles:
                if entry == str(i) or (not entry.isdigit() and self._uuid(h).startswith(entry)):
                    out.append((i, h))
                    break
            else:
                # CUDA stops at the first invalid entry; so do we.
                break
        return out

    def _uuid(self, handle: Any) -> str:
        u = self._nvml.nvmlDeviceGetUUID(handle)
        return u.decode() if isinstance(u, bytes) else str(u)

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def visible(self) -> list[tuple[int, Any]]:
        """(NVML index, handle) of each GPU this process sees, in CUDA_VISIBLE_DEVICES order."""
        return list(self._handles)

    def process_memory(self, position: int, pid: int) -> int | None:
        """GPU memory (bytes) process `pid` holds on the visible GPU at `position`; None when NVML
        cannot tell (no GPU, no such process there)."""
        if position >= len(self._handles):
            return None
        with self._lock:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handles[position][1])
            except Exception:  # an unsupported query must not break /metrics
                return None
        used = [int(p.usedGpuMemory) for p in procs if int(p.pid) == pid and p.usedGpuMemory is not None]
        return sum(used) if used else None

    def sample(self) -> list[GpuSample]:
        """Read every visible GPU; a device that errors is skipped (and logged once per call)."""
        out: list[GpuSample] = []
        with self._lock:
            for index, handle in self._handles:
                try:
                    util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                    mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                except Exception as e:  # a GPU fallen off the bus must not break /metrics
                    log.warning("nvml read failed", extra={"gpu": index, "error": type(e).__name__})
                    continue
                out.append(GpuSample(index, float(util.gpu) / 100.0, int(mem.used), int(mem.total)))
        return out

    def update(self) -> int:
        """Sample and set the gauges; returns how many GPUs were reported."""
        samples = self.sample()
        for s in samples:
            gpu = str(s.index)
            self.metrics.gpu_utilization.labels(gpu=gpu).set(s.utilization)
            self.metrics.gpu_memory_bytes.labels(gpu=gpu, kind="used").set(s.memory_used_bytes)
            self.metrics.gpu_memory_bytes.labels(gpu=gpu, kind="total").set(s.memory_total_bytes)
        return len(samples)

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            # Shutting down; nothing useful to do with an NVML error here.
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._handles = []
