"""A dead trainer rank is a dead service: kill -9 of the actor's follower rank fails the actor
fast and the supervisor restarts it; kill -9 of rank 0 takes its follower with it (no orphan).
Either way the run completes and `rlfleet audit` passes, with a 2-rank critic (PPO) beside it
checkpointing DCP shards."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.faults.test_faults import fault_config, run_factory  # noqa: F401 - run_factory is a fixture
from tests.fleet_helpers import gone

pytestmark = pytest.mark.slow


def _follower(actor_pid: int, within_s: float = 120.0) -> int:
    """The actor's follower rank, once it has one: a restarted actor starts it during its start-up."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            for pid in Path(f"/proc/{actor_pid}/task/{actor_pid}/children").read_text().split():
                if b"services.dist.follower" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
        except OSError:  # a child that exited between the listing and the read
            pass
        time.sleep(0.2)
    raise AssertionError(f"the actor has no follower rank after {within_s:.0f}s")


def _restarted(run, times: int, within_s: float = 60.0):  # type: ignore[no-untyped-def]
    """The supervisor's record of the actor once it has restarted `times` times (the step after a
    kill may complete before the actor notices the dead rank: it checks once a second)."""
    deadline = time.monotonic() + within_s
    while run.fleet.procs["actor"].restarts < times and time.monotonic() < deadline:
        time.sleep(0.1)
    actor = run.fleet.procs["actor"]
    assert actor.restarts == times, f"the actor restarted {actor.restarts} times, not {times}"
    return actor


def test_kill9_of_either_actor_rank_restarts_the_actor_and_the_run_completes(
        tmp_path: Path, tiny_model: Path, run_factory) -> None:  # noqa: F811
    # PPO: the critic trains (and scores) on 2 ranks through the whole run as well.
    cfg = fault_config(tmp_path / "run", tiny_model,
                       services={"actor": {"trainer_ranks": 2}, "critic": {"trainer_ranks": 2}})
    run = run_factory(cfg)
    first = run.fleet.procs["actor"].proc.pid
    follower = _follower(first)
    run.fault("kill -9 actor follower rank", lambda: os.kill(follower, signal.SIGKILL), at_step=2)
    actor = _restarted(run, 1)
    assert actor.proc.pid != first, "a dead rank fails the whole actor"
    assert gone(first), "rank 0 outlived its dead follower"

    second = actor.proc.pid
    follower = _follower(second)
    run.fault("kill -9 actor rank 0", lambda: os.kill(second, signal.SIGKILL), at_step=5)
    assert gone(follower), "the follower outlived rank 0 (an orphan)"
    run.finish()
    assert run.fleet.procs["actor"].restarts == 2
    assert run.fleet.procs["critic"].restarts == 0
    cdir = cfg.checkpoint_dir / "critic"
    meta = json.loads((cdir / (cdir / "latest").read_text().strip() / "meta.json").read_text())
    assert meta["layout"] == "dcp" and meta["ranks"] == 2
