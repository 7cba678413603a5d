"""Progress lines for output that is not a terminal."""

from __future__ import annotations

import io

from services.progress import ProgressLine, duration


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_durations_read_as_hours_minutes_seconds() -> None:
    assert [duration(s) for s in (0, 12.4, 185, 3720)] == ["0s", "12s", "3m05s", "1h02m"]


def test_a_line_every_interval_with_an_eta_from_the_observed_rate_and_always_the_last_step() -> None:
    clock, out = Clock(), io.StringIO()
    line = ProgressLine("run", total=10, every_s=5.0, out=out, clock=clock)
    assert line.update(0)  # the first update prints: the run has started
    printed = []
    for step in range(1, 11):
        clock.t += 2.0  # 2 s per step
        printed.append(line.update(step, "reward 0.5"))
    # Due at 6 s, 12 s, 18 s (steps 3, 6, 9), and the final step regardless of the interval.
    assert printed == [False, False, True, False, False, True, False, False, True, True]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("run: step 0/10 (0%)") and "eta ?" in lines[0]
    assert lines[1] == "run: step 3/10 (30%)  elapsed 6s  eta 14s  reward 0.5"
    assert lines[-1].startswith("run: step 10/10 (100%)  elapsed 20s  eta 0s")


def test_a_resumed_run_counts_only_the_steps_it_ran_for_the_eta() -> None:
    clock, out = Clock(), io.StringIO()
    line = ProgressLine("run", total=100, every_s=0.0, out=out, clock=clock)
    line.update(90)  # resumed at step 90
    clock.t += 10.0
    line.update(95)
    assert "eta 10s" in out.getvalue().splitlines()[-1]
