"""Medians and percentiles of timing samples (seconds in, milliseconds out)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """n, p50, p99, mean, min, max of samples in seconds, reported in milliseconds."""
    ms = [x * 1e3 for x in samples_s]
    if not ms:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "mean": math.nan, "min": math.nan, "max": math.nan}
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "mean": sum(ms) / len(ms),
        "min": min(ms),
        "max": max(ms),
    }


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50)
