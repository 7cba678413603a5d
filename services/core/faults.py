"""Named fault points, for tests that must hit one exact moment (a kill between two writes).

Off unless the environment says otherwise. `RLFLEET_FAULT_HOOK=<point>@<step>` makes the process
that reaches `point` while working on training step `step` pause there (several, comma-separated,
pause one run at each in turn): it writes `RUN_DIR/faults/<point>@<step>.reached`, then waits
(without blocking its event loop, so every other loop of the service keeps running into the gap)
until a test creates `RUN_DIR/faults/<point>@<step>.release`. The test does its damage in between.
A point is hit once per process; a replacement that gets the same environment passes it (the marker
is there).

A fault that damages rather than pauses lives where the damage is done: `RLFLEET_FAULT_WEIGHTS`
(`services.models.weights.check.corrupt`) makes an engine process load one tensor of a weight sync
one ulp off, so that tests see the sync's checksum check stop it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

log = logging.getLogger("rlfleet.faults")

ENV = "RLFLEET_FAULT_HOOK"


def fault_dir(run_dir: Path) -> Path:
    return run_dir / "faults"


def armed() -> frozenset[str]:
    """The `<point>@<step>` names the environment arms in this process."""
    return frozenset(x.strip() for x in os.environ.get(ENV, "").split(",") if x.strip())


async def fault_point(run_dir: Path, point: str, step: int) -> None:
    """Pause here when the environment names this point and step; otherwise return at once."""
    if f"{point}@{step}" not in armed():
        return
    d = fault_dir(run_dir)
    reached = d / f"{point}@{step}.reached"
    if reached.exists():
        return
    d.mkdir(parents=True, exist_ok=True)
    reached.write_text(str(os.getpid()))
    log.warning("fault point reached; paused until released", extra={"point": point, "step": step})
    release = d / f"{point}@{step}.release"
    while not release.exists():
        await asyncio.sleep(0.05)
    log.warning("fault point released", extra={"point": point, "step": step})
