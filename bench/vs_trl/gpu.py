"""GPU utilization and memory sampled with NVML while the phases run (silent without NVML)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any


class GpuSampler(threading.Thread):
    """NVML utilization and memory of GPU 0 every `period` seconds; silent (no samples) without NVML."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period, self.stop = period, threading.Event()
        self.samples: list[tuple[float, float, float]] = []
        self.idle_gib: float | None = None  # see mark_idle
        self.name = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            raw = pynvml.nvmlDeviceGetName(self.h)
            self.name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception:
            self.nvml = None

    def run(self) -> None:
        while self.nvml is not None and not self.stop.is_set():
            try:
                u = self.nvml.nvmlDeviceGetUtilizationRates(self.h)
                m = self.nvml.nvmlDeviceGetMemoryInfo(self.h)
                self.samples.append((time.time(), float(u.gpu), m.used / 2**30))
            except Exception:
                pass
            time.sleep(self.period)

    def mark_idle(self) -> None:
        """Take the GPU memory in use now (no phase running) as the level `wait_released` waits for."""
        if self.nvml is not None:
            self.idle_gib = self.nvml.nvmlDeviceGetMemoryInfo(self.h).used / 2**30

    def wait_released(self, timeout_s: float = 30.0, slack_gib: float = 2.0) -> float:
        """Wait until the GPU's memory is back near its idle level (a killed phase's processes free
        theirs a moment after they exit): the next phase's vLLM sizes its cache from what is free.
        Returns the seconds waited (0 without NVML)."""
        idle = self.idle_gib
        if self.nvml is None or idle is None:
            return 0.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.nvml.nvmlDeviceGetMemoryInfo(self.h).used / 2**30 <= idle + slack_gib:
                break
            time.sleep(0.2)
        return time.monotonic() - t0

    def between(self, t0: float, t1: float) -> list[tuple[float, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]


def mean_util(samples: list[tuple[float, float, float]]) -> float | None:
    return statistics.fmean(s[1] for s in samples) if samples else None
