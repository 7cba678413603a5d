"""Progress as plain lines, for output that is not a terminal (CI logs, `nohup`, a pipe): a line
every few seconds with the step, the rate and an estimate of the time left."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def duration(seconds: float) -> str:
    """"1h02m", "3m05s", "12s"."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class ProgressLine:
    """`update(step, info)` prints at most one line per `every_s` seconds, and always the last step.

    The rate, and so the ETA, counts only the steps seen since the first update: a resumed run's
    earlier steps took no time here."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.out = out if out is not None else sys.stdout
        self.clock = clock
        self.t0 = clock()
        self.first_step: int | None = None
        self.t_first = self.t0
        self.last_print = float("-inf")
        self.last_step = -1

    def line(self, step: int, info: str = "") -> str:
        now = self.clock()
        text = f"{self.label}: step {step}/{self.total} ({100 * step / max(1, self.total):.0f}%)"
        text += f"  elapsed {duration(now - self.t0)}"
        done = step - (self.first_step or 0)
        if self.first_step is not None and done > 0 and now > self.t_first:
            eta = (self.total - step) * (now - self.t_first) / done
            text += f"  eta {duration(eta)}"
        else:
            text += "  eta ?"
        return text + (f"  {info}" if info else "")

    def update(self, step: int, info: str = "") -> bool:
        """Print a line if one is due; returns whether it did."""
        now = self.clock()
        if self.first_step is None:
            self.first_step, self.t_first = step, now
        due = now - self.last_print >= self.every_s or (step >= self.total and step != self.last_step)
        if not due:
            return False
        print(self.line(step, info), file=self.out, flush=True)
        self.last_print, self.last_step = now, step
        return True
