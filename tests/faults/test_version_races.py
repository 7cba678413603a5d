"""A trainable service killed at every moment of a step commit, deterministically, and a controller
drained mid-step. The controller pauses at a named fault point (services/core/faults.py) while the
rest of the fleet, its own admission included, keeps running into the gap; the test kills the
victims there, lets their replacements start, then releases the step. Every case must finish all
its steps with no controller restart and `rlfleet audit` passing: no version stamped that the
controller was leaving, no replacement generating, scoring or reporting ready below the committed
version (invariant 4: "actor served version 10 after serving version 14")."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.audit import audit
from services.core.config.run import RunConfig
from services.core.faults import ENV, fault_dir
from services.fleet import Fleet, read_service_files
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.slow

STEPS = 4
AT = 3  # the first step whose commit is interrupted: the victims' latest checkpoint (every 2) is one version behind
POINTS = ["step_journaled", "trained", "versions_published", "journal_committed"]


def race_config(run_dir: Path, model: Path, algo: str, **sections: dict[str, Any]) -> RunConfig:
    algos = {"grpo": {"name": "grpo", "group_size": 2, "kl_coef": 0.0},
             "ppo": {"name": "ppo", "group_size": 2, "kl_coef": 0.0, "minibatch_size": 8}}
    base: dict[str, dict[str, Any]] = {
        "run": {"max_steps": STEPS},
        "algo": algos[algo],
        "batch": {"prompts_per_step": 4, "prompts_per_message": 2},
        "flow": {"resend_after_s": 4.0, "reclaim_idle_ms": 1500, "rpc_timeout_s": 120.0},
        "checkpoint": {"every": 2},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(run_dir, model, **base)


def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        time.sleep(0.1)


def _ready(fleet: Fleet, name: str) -> bool:
    try:
        return fleet.http(name, "/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def _up(fleet: Fleet, name: str) -> bool:
    """The replacement runs its service loop: it answers /readyz past connecting to Redis (ready,
    or not ready with its reasons: catching up)."""
    info = read_service_files(fleet.run_dir).get(name) or {}
    if info.get("pid") != fleet.procs[name].proc.pid:
        return False
    try:
        r = fleet.http(name, "/readyz")
    except httpx.HTTPError:
        return False
    return r.status_code == 200 or "connecting to redis" not in r.json().get("reasons", ["connecting to redis"])


# Every moment with both trainables killed (PPO), one run pausing at each in turn, two steps apart so
# that each pair of replacements starts from the checkpoint one version behind the step; the GRPO
# actor alone at the moment the run was lost at (the journal committed, Redis not yet told):
# the other GRPO moments are the same code path.
PPO_KILLS = {p: AT + 2 * i for i, p in enumerate(POINTS)}
CASES = [pytest.param("ppo", ("actor", "critic"), PPO_KILLS, id="ppo-actor+critic-at-every-point"),
         pytest.param("grpo", ("actor",), {"journal_committed": AT}, id="grpo-actor-journal_committed")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("algo", "victims", "kills"), CASES)
def test_a_trainable_killed_at_any_moment_of_a_step_commit_catches_up_before_it_serves(
    algo: str, victims: tuple[str, ...], kills: dict[str, int], tmp_path: Path, tiny_model: Path,
    fleet_factory: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, ",".join(f"{point}@{step}" for point, step in kills.items()))
    steps = max(kills.values()) + 1
    cfg = race_config(tmp_path / "run", tiny_model, algo, run={"max_steps": steps})
    fleet = fleet_factory(cfg, restart_budget=len(kills) + 1)
    fleet.start(ready_timeout_s=180)
    result: list[Any] = []
    sup = threading.Thread(target=lambda: result.append(_supervise(fleet)), daemon=True)
    sup.start()
    try:
        for point, step in kills.items():
            _kill_in_the_gap(fleet, cfg, f"{point}@{step}", victims, result)
        sup.join(timeout=360)
    finally:
        fleet.restart_budget = 0  # a supervisor still running must not restart what teardown stops
    assert result == [0], f"supervise: {result}"
    assert fleet.procs["controller"].restarts == 0, "the controller crashed (a stamped stale version?)"
    assert {v: fleet.procs[v].restarts for v in victims} == dict.fromkeys(victims, len(kills))
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    report = audit(cfg.run_dir, finished=True)
    assert report.ok, report.render()


def _kill_in_the_gap(fleet: Fleet, cfg: RunConfig, fault: str, victims: tuple[str, ...], result: list[Any]) -> None:
    marker = fault_dir(cfg.run_dir) / fault
    _until(lambda: marker.with_suffix(".reached").exists() or bool(result), 180,
           f"the controller did not reach {fault}")
    assert not result, f"the run ended before {fault}: {result}"
    old = {v: fleet.procs[v].proc.pid for v in victims}
    for v in victims:
        os.kill(old[v], signal.SIGKILL)
    for v in victims:
        _until(lambda v=v: fleet.procs[v].proc.pid != old[v] and _up(fleet, v), 180, f"no replacement {v}")
    # The gap stays open while the replacements start serving, if they (wrongly) would: a few
    # seconds after each is ready, or after it has been up and not ready for as long.
    t0 = time.monotonic()
    _until(lambda: all(_ready(fleet, v) for v in victims) or time.monotonic() - t0 > 5.0, 10, "replacements")
    time.sleep(3.0)
    marker.with_suffix(".release").write_text("go")


def _supervise(fleet: Fleet) -> int | BaseException:
    try:
        return fleet.supervise(timeout_s=420, poll_s=0.2)
    except BaseException as e:  # surfaced by the test's assertion
        return e


@pytest.mark.timeout(600)
def test_a_controller_drained_mid_step_stops_its_loops_before_closing_the_journal(
    tmp_path: Path, tiny_model: Path, fleet_factory: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drain (POST /v1/drain) while a step has trained but not committed: the step finishes, every
    loop ends, then the journal closes; no loop touches a closed journal, the controller exits 0."""
    monkeypatch.setenv(ENV, "trained@2")
    cfg = race_config(tmp_path / "run", tiny_model, "grpo", run={"max_steps": 50})
    fleet = fleet_factory(cfg, restart_budget=0)
    fleet.start(ready_timeout_s=180)
    marker = fault_dir(cfg.run_dir) / "trained@2"
    ctl = fleet.procs["controller"]
    _until(lambda: marker.with_suffix(".reached").exists(), 240, "the controller did not reach trained@2")
    assert fleet.cfg is not None
    port = fleet.cfg.endpoint("controller").http_port  # ports are chosen when the fleet starts
    assert httpx.post(f"http://127.0.0.1:{port}/v1/drain", timeout=5).status_code == 202
    time.sleep(1.5)  # the drain is under way while the step is still in the gap
    marker.with_suffix(".release").write_text("go")
    assert ctl.proc.wait(timeout=180) == 0
    log = ctl.log_path.read_text()
    for bad in ("never retrieved", "is closed", "Traceback"):
        assert bad not in log, f"controller log has {bad!r}:\n{log[-3000:]}"
    from services.core.journal.journal import Journal

    with Journal.open(cfg.journal_dir, readonly=True) as j:
        assert j.step == 2, "the step in progress at the drain was committed, not dropped"
    events = [json.loads(x) for x in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "trained"] == [1, 2]
