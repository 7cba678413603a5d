"""The fleet end to end: every service its own process, a real redis-server, real models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.local import run_local
from services.report import read_metrics, write_report
from tests.fleet_helpers import gone, scrape, tiny_config

pytestmark = pytest.mark.slow


def _rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def test_fleet_matches_local_loop_on_policy(tmp_path: Path, tiny_model: Path, fleet_factory) -> None:
    """max_staleness 0 and one seed: the fleet learns exactly like the single-process loop."""
    steps = 3
    local_cfg = tiny_config(tmp_path / "local", tiny_model, run={"max_steps": steps})
    run_local(local_cfg)
    fleet_cfg = tiny_config(tmp_path / "fleet", tiny_model, run={"max_steps": steps})
    fleet = fleet_factory(fleet_cfg)
    fleet.start(ready_timeout_s=180)
    # The services that import torch are forks of the zygote (services.prefork), the others the launcher's.
    parent = {name: int(Path(f"/proc/{sp.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
              for name, sp in fleet.procs.items()}
    zygote = fleet.launcher.zygote
    forked = {"actor", "reference"} if zygote is not None else set()
    assert {n for n, pid in parent.items() if zygote is not None and pid == zygote.pid} == forked, parent
    assert {n for n, pid in parent.items() if pid == os.getpid()} == set(parent) - forked, parent
    assert fleet.supervise(timeout_s=240) == 0
    local, remote = _rows(tmp_path / "local"), _rows(tmp_path / "fleet")
    assert [r["step"] for r in remote] == list(range(1, steps + 1))
    for a, b in zip(local, remote, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-4)
        assert b["policy_loss"] == pytest.approx(a["policy_loss"], abs=1e-4)
    pids = {sp.proc.pid for sp in fleet.procs.values()}
    assert len(pids) == len(fleet_cfg.services_needed())
    report = write_report(tmp_path / "fleet")
    assert "data:image/png;base64" in report.read_text()


def test_engine_in_its_own_process_learns_exactly_like_the_in_process_engine(
    tmp_path: Path, tiny_model: Path, fleet_factory
) -> None:
    """generation.process: the actor's engine runs in a child process (weights by shared memory) and
    the run is step for step the single-process loop's; the child is one more process of the actor.
    Nothing profiles memory there (the transformers engine), so the trainer is built while it starts."""
    steps = 3
    run_local(tiny_config(tmp_path / "local", tiny_model, run={"max_steps": steps}))
    cfg = tiny_config(tmp_path / "fleet", tiny_model, run={"max_steps": steps}, generation={"process": True})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    actor = fleet.procs["actor"].proc.pid
    children = Path(f"/proc/{actor}/task/{actor}/children").read_text().split()
    assert children, "the actor started no engine process"
    assert fleet.supervise(timeout_s=240) == 0
    assert "trainer built while the engine starts" in (cfg.run_dir / "logs" / "actor.log").read_text()
    for a, b in zip(_rows(tmp_path / "local"), _rows(tmp_path / "fleet"), strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-4)
    fleet.stop(grace_s=30)  # the actor drains: its engine process goes with it
    assert gone(*map(int, children), within_s=10), "the engine process outlived the actor"


def _total(sample: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in sample.items() if k.startswith(prefix))


def test_ppo_fleet_metrics_move_during_a_run(tmp_path: Path, tiny_model: Path, fleet_factory) -> None:
    """PPO starts a critic; /metrics of every service shows work happening while the run goes on."""
    cfg = tiny_config(tmp_path / "ppo", tiny_model, run={"max_steps": 6},
                      algo={"name": "ppo", "group_size": 2, "kl_coef": 0.05, "kl_in": "reward"},
                      batch={"prompts_per_step": 16, "prompts_per_message": 4})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    assert set(fleet.procs) == {"controller", "actor", "reward", "reference", "critic"}
    assert fleet.cfg is not None
    # Keep the last scrape of each service while the run goes on (the run may end between polls).
    after = {n: scrape("127.0.0.1", fleet.cfg.endpoint(n).http_port) for n in fleet.procs}
    deadline = time.monotonic() + 240
    while fleet.procs["controller"].alive and time.monotonic() < deadline:
        for n in fleet.procs:
            try:
                after[n] = scrape("127.0.0.1", fleet.cfg.endpoint(n).http_port)
            except httpx.HTTPError:
                pass
        if after["controller"].get('rlfleet_policy_version{service="controller"}', 0) >= 2:
            break
        time.sleep(0.2)
    # Counters and the version gauge start at zero with the process: generation, and on a fast host
    # the first steps too (CI saw version 2 at the first scrape), may all have happened before the
    # first scrape (admission runs max_staleness steps ahead), so "moved" is measured from zero.
    assert _total(after["actor"], 'rlfleet_tokens_total{phase="generate"') > 0
    for stage in ("reward", "reference", "critic"):
        assert _total(after[stage], 'rlfleet_samples_total{phase="score"') > 0, stage
    assert after["controller"]['rlfleet_policy_version{service="controller"}'] >= 2
    status = subprocess.run([sys.executable, "-m", "services.cli", "status", "--json", "--run-dir", str(cfg.run_dir)],
                            capture_output=True, text=True, timeout=60)
    if fleet.procs["controller"].alive:  # the run may have ended meanwhile
        assert status.returncode == 0, status.stderr
        fleet_status = json.loads(status.stdout)
        assert {"controller", "actor", "critic", "reward", "reference"} <= set(fleet_status)
        for row in fleet_status.values():
            assert {"pid", "host", "grpc_port", "http_port", "state"} <= set(row)
    assert _total(after["actor"], "rlfleet_stage_latency_seconds_count") > 0
    # A step's four messages wait for the engine together: the actor generates them in joined calls.
    calls = _total(after["actor"], "rlfleet_engine_call_messages_count")
    assert 0 < calls < _total(after["actor"], "rlfleet_engine_call_messages_sum")
    assert any(k.startswith("rlfleet_fill_ratio") for k in after["actor"])
    assert fleet.supervise(timeout_s=240) == 0
    rows = _rows(tmp_path / "ppo")
    assert len(rows) == 6 and all("value_loss" in r for r in rows)
    events = [json.loads(x)["kind"] for x in (tmp_path / "ppo" / "events.jsonl").read_text().splitlines()]
    assert events.count("trained") == 6


def test_grpo_without_kl_starts_no_critic_and_no_reference_and_scales_reward(
    tmp_path: Path, tiny_model: Path, fleet_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also the secured path: a shared token on every gRPC call and admin route, and a Redis password."""
    monkeypatch.setenv("RLF_TEST_TOKEN", "s3cret-token")
    monkeypatch.setenv("RLF_TEST_REDIS_PW", "s3cret-redis")
    cfg = tiny_config(tmp_path / "grpo", tiny_model, run={"max_steps": 2}, algo={"kl_coef": 0.0},
                      security={"token_env": "RLF_TEST_TOKEN"}, redis={"password_env": "RLF_TEST_REDIS_PW"},
                      services={"reward": {"replicas": 2}})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    assert set(fleet.procs) == {"controller", "actor", "reward", "reward-1"}, "two reward replicas, one group"
    assert fleet.http("reward-1", "/readyz").status_code == 200
    assert fleet.cfg is not None and fleet.redis is not None
    import redis as redis_lib

    with pytest.raises(redis_lib.AuthenticationError):
        redis_lib.Redis(port=fleet.redis.port).ping()
    port = fleet.cfg.endpoint("actor").http_port
    assert httpx.post(f"http://127.0.0.1:{port}/v1/drain", timeout=2).status_code == 401
    wrong = {"authorization": "Bearer nope"}
    assert httpx.post(f"http://127.0.0.1:{port}/v1/drain", headers=wrong, timeout=2).status_code == 401
    for name in ("s3cret-token", "s3cret-redis"):
        for log in (tmp_path / "grpo" / "logs").glob("*.log"):
            assert name not in log.read_text(), f"a secret leaked into {log.name}"
    assert fleet.supervise(timeout_s=240) == 0
    assert len(_rows(tmp_path / "grpo")) == 2
