"""The actor as leader of a 2-host trainer group, on one machine: the actor service gets the env the
LeaderWorkerSet overlay sets on the leader pod (RLFLEET_DIST_NODES=2, ..._GPUS_PER_NODE=1, a
store port) and a separate `python -m services.dist.node --node-rank 1` process, started before the
fleet (so it waits for rank 0), is the second rank. Its steps are the 1-rank run's; kill -9 of the
node fails the actor fast (the supervisor restarts it and it waits for a node again, as LWS would
recreate the worker pod) and the run completes with the audit passing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from services.local import run_local
from services.report import read_metrics
from tests.faults.test_faults import run_factory  # noqa: F401 - a fixture
from tests.fleet_helpers import free_port, start_dist_node, tiny_config

pytestmark = pytest.mark.slow

STEPS = 2  # compared with the 1-rank run; the 2-node run goes on 2 more, past the kill


def _restarts(run, at_least: int, within_s: float) -> int:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while run.fleet.procs["actor"].restarts < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(run.fleet.procs["actor"].restarts)


def test_two_node_actor_learns_like_one_rank_and_a_dead_node_restarts_the_actor(
        tmp_path: Path, tiny_model: Path, run_factory, monkeypatch) -> None:  # noqa: F811
    base = {"checkpoint": {"every": 1}, "flow": {"rpc_timeout_s": 120.0}}
    # The 1-rank reference is the single-process loop, which the 1-rank fleet matches step for step
    # (tests/e2e/test_fleet.py): a third fleet would only cost time.
    ref = read_metrics(run_local(tiny_config(tmp_path / "one", tiny_model, run={"max_steps": STEPS}, **base)))

    port = free_port()
    # The overlay leaves trainer_ranks at 1: the environment defines the 2-rank world.
    for k, v in {"NODES": "2", "GPUS_PER_NODE": "1", "STORE_PORT": str(port), "NODE_TIMEOUT_S": "10"}.items():
        monkeypatch.setenv(f"RLFLEET_DIST_{k}", v)
    # Before the leader: it retries until rank 0 listens.
    nodes = [start_dist_node(port, tmp_path / "node.log", connect_timeout_s=240, new_session=True)]
    try:
        cfg = tiny_config(tmp_path / "two", tiny_model, run={"max_steps": STEPS + 2}, **base)
        run = run_factory(cfg)
        status = run.fleet.status()["actor"]["detail"]["ranks"]
        assert [(r["rank"], r["node"], r["alive"]) for r in status] == [(0, 0, True), (1, 1, True)]

        def kill_node_then_replace_it() -> None:
            os.kill(nodes[0].pid, signal.SIGKILL)
            assert _restarts(run, 1, within_s=120) == 1, "a dead node fails the actor"
            # LWS would recreate the worker pod.
            nodes.append(start_dist_node(port, tmp_path / "node.log", connect_timeout_s=240, new_session=True))

        run.fault("kill -9 the actor's worker node", kill_node_then_replace_it, at_step=STEPS)
        run.finish()
        two = read_metrics(cfg.run_dir / "metrics.jsonl")
        for a, b in zip(ref, two[:STEPS], strict=True):
            assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
            assert b["kl"] == pytest.approx(a["kl"], abs=1e-4)
            assert b["policy_loss"] == pytest.approx(a["policy_loss"], abs=1e-4)
        assert run.fleet.procs["actor"].restarts == 1
        run.fleet.stop(grace_s=30)
        # rank 0 stopped the group: the node's rank exits cleanly and so does the node.
        assert nodes[1].wait(timeout=60) == 0
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
