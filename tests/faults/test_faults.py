"""Fault injection against a real fleet on the tiny task. Every case ends with the run completing
all its steps and `rlfleet audit` passing (no loss, exactly-once, bounded staleness, monotonic
versions, bounded resources). Recovery time (fault to the next completed step) is recorded and
printed at the end of the session. The faults a fleet of the default fault config heals from
without a trace share one fleet (TestOneFleet); those that need a config of their own start theirs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from services.audit import audit
from services.core.config.run import RunConfig
from services.core.host.redis_proc import start_redis
from services.core.pb import rlfleet_pb2 as pb
from services.fleet import Fleet
from services.report import read_metrics
from services.swap import swap
from tests.fleet_helpers import controller_detail, rss_bytes, scrape, tiny_config, wait_for_step

pytestmark = pytest.mark.slow

RECOVERY: list[tuple[str, float]] = []
STEPS = 8


def fault_config(run_dir: Path, model: Path, **sections: dict[str, Any]) -> RunConfig:
    """PPO with KL, so every service runs; small steps and short timeouts so faults heal fast."""
    base: dict[str, dict[str, Any]] = {
        "run": {"max_steps": STEPS},
        "algo": {"name": "ppo", "group_size": 2, "kl_coef": 0.05, "kl_in": "reward", "minibatch_size": 16},
        "batch": {"prompts_per_step": 8, "prompts_per_message": 4},
        "flow": {"resend_after_s": 4.0, "reclaim_idle_ms": 1500, "rpc_timeout_s": 120.0},
        "checkpoint": {"every": 2},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(run_dir, model, **base)


class Run:
    """A fleet supervised in a background thread while the test injects faults."""

    def __init__(self, fleet: Fleet, cfg: RunConfig, timeout_s: float = 300) -> None:
        self.fleet, self.cfg, self.timeout_s = fleet, cfg, timeout_s
        self.result: int | BaseException | None = None
        fleet.start(ready_timeout_s=180)
        self.thread = threading.Thread(target=self._supervise, daemon=True)
        self.thread.start()

    def _supervise(self) -> None:
        try:
            self.result = self.fleet.supervise(timeout_s=self.timeout_s, poll_s=0.2)
        except BaseException as e:  # surfaced in finish()
            self.result = e

    def step(self) -> int:
        return int(controller_detail(self.fleet).get("step", 0))

    def restarts(self) -> dict[str, int]:
        return {name: sp.restarts for name, sp in self.fleet.procs.items()}

    def expect_steps_left(self, steps: int) -> None:
        """A test on a shared run needs `steps` more of it: fail at once, naming the budget, rather
        than wait on a run that has ended."""
        assert self.result is None, f"the shared run has ended (supervise: {self.result!r})"
        left = self.cfg.run.max_steps - self.step()
        assert left >= steps, f"the shared run has {left} steps left, this fault needs {steps}: raise SHARED_STEPS"

    def fault(self, name: str, inject: Callable[[], Any], at_step: int = 2) -> float:
        """Inject at `at_step`; return the seconds until the next step completes."""
        wait_for_step(self.fleet, at_step)
        before = self.step()
        t0 = time.monotonic()
        inject()
        t1 = wait_for_step(self.fleet, before + 1, timeout_s=240)
        RECOVERY.append((name, t1 - t0))
        return t1 - t0

    def finish(self) -> None:
        self.thread.join(timeout=self.timeout_s + 20)
        assert not isinstance(self.result, BaseException), repr(self.result)
        assert self.result == 0, f"supervise returned {self.result}"
        rows = read_metrics(self.cfg.run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, self.cfg.run.max_steps + 1))
        report = audit(self.cfg.run_dir, finished=True)
        assert report.ok, report.render()


@pytest.fixture
def run_factory(fleet_factory: Any) -> Iterator[Callable[[RunConfig], Run]]:
    def make(cfg: RunConfig) -> Run:
        return Run(fleet_factory(cfg, restart_budget=3), cfg)

    yield make


def kill9(fleet: Fleet, name: str) -> Callable[[], None]:
    return lambda: os.kill(fleet.procs[name].proc.pid, signal.SIGKILL)


# The controller first: the run must outlast every later restart, and the steps go on quickly.
KILLED = ["controller", "actor", "critic", "reward", "reference"]


def _ready(fleet: Fleet, name: str) -> bool:
    try:
        return fleet.http(name, "/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def _engine_child(actor_pid: int) -> int:
    for pid in Path(f"/proc/{actor_pid}/task/{actor_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError("the actor has no engine process")


def test_kill9_of_the_engine_process_fails_the_actor_fast_and_it_recovers(
    tmp_path: Path, tiny_model: Path, run_factory
) -> None:
    """generation.process: a dead engine child makes the actor exit (it cannot generate any more);
    the supervisor restarts the actor, which starts a new engine, and no work is lost."""
    cfg = fault_config(tmp_path / "run", tiny_model, generation={"process": True})
    run = run_factory(cfg)
    actor = run.fleet.procs["actor"].proc.pid
    engine = _engine_child(actor)
    run.fault("kill -9 engine process (generation.process)", lambda: os.kill(engine, signal.SIGKILL))
    run.finish()
    assert run.fleet.procs["actor"].restarts == 1 and run.fleet.procs["actor"].proc.pid != actor
    assert "engine" in (cfg.run_dir / "logs" / "actor.log").read_text()


def _restart_redis(fleet: Fleet, empty: bool) -> Callable[[], None]:
    def go() -> None:
        rp = fleet.redis
        assert rp is not None
        rp.stop(kill=True)
        if empty:
            for child in rp.dir.iterdir():
                if child.name.startswith("appendonly"):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        time.sleep(1.0)
        fleet.redis = start_redis(rp.dir, port=rp.port)

    return go


def test_slow_scorer_is_held_by_backpressure(tmp_path: Path, tiny_model: Path, run_factory) -> None:
    """A scorer that stalls (SIGSTOP until the actor holds, then a while longer) in repeated cycles:
    each time the actor holds, the scorer's queue plateaus at the high watermark instead of growing
    to the admission window, the actor resumes once the scorer drains below the low watermark, and
    the actor's memory stays flat. The stalled scorer is the reference: it has no Train call, so a
    stall never stops the step (and with it admission) before its queue fills, and stalling until
    the hold is seen keeps the case independent of how fast this machine generates."""
    cfg = fault_config(tmp_path / "run", tiny_model, run={"max_steps": 40},
                       flow={"max_staleness": 3, "stream_capacity": 4, "high_watermark": 0.7,
                             "low_watermark": 0.3})
    run = run_factory(cfg)
    assert run.fleet.cfg is not None and run.fleet.redis is not None
    r = redis.Redis(port=run.fleet.redis.port)
    actor_port = run.fleet.cfg.endpoint("actor").http_port  # ports are chosen when the fleet starts
    depths: list[int] = []
    rss: list[int] = []

    def stalled_depth() -> int:
        for g in r.xinfo_groups(f"rlfleet:{cfg.run.name}:rollouts"):
            if g["name"] == b"reference":
                return int(g.get("lag") or 0) + int(g["pending"])
        return 0

    def held() -> bool:
        return scrape("127.0.0.1", actor_port).get('rlfleet_backpressure{service="actor"}', 0.0) == 1.0

    def until(cond: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and run.result is None and run.fleet.procs["actor"].alive:
            depths.append(stalled_depth())
            rss.append(rss_bytes(run.fleet.procs["actor"].proc.pid))
            try:
                if cond():
                    return True
            except httpx.HTTPError:
                pass  # the actor is between restarts or the run is ending: no reading this time
            time.sleep(0.1)
        return False

    wait_for_step(run.fleet, 1)
    engaged = released = 0
    try:
        for _ in range(6):
            if engaged == 3:
                break
            stalled = run.fleet.procs["reference"].proc.pid
            os.kill(stalled, signal.SIGSTOP)
            try:
                if until(held, 30.0):
                    engaged += 1
                    until(lambda: False, 2.0)  # held for a while: the queue must not keep growing
            finally:
                os.kill(stalled, signal.SIGCONT)
            if until(lambda: not held(), 60):
                released += 1
        run.finish()
    finally:
        if run.fleet.procs["reference"].alive:
            os.kill(run.fleet.procs["reference"].proc.pid, signal.SIGCONT)
    window = (cfg.flow.max_staleness + 1) * cfg.batch.prompts_per_step // cfg.batch.prompts_per_message
    plateau = cfg.flow.high_watermark * cfg.flow.stream_capacity
    assert engaged >= 2 and released >= engaged, f"backpressure engaged {engaged} and released {released} times"
    # One message may be in generation when the hold starts, and the controller's group counts too.
    assert max(depths) <= plateau + 2 < window, (max(depths), plateau, window)
    half = rss[len(rss) // 2:]
    assert max(half) - min(half) < 64 * 1024 * 1024, "actor memory grew while held"


def _stream(cfg: RunConfig, name: str) -> str:
    return f"rlfleet:{cfg.run.name}:{name}"


def _journal_tasks(cfg: RunConfig) -> list[Any]:
    from services.core.journal.journal import Journal

    with Journal.open(cfg.journal_dir, readonly=True) as j:
        return list(j.iter_tasks())


def test_a_reward_failing_on_some_rows_ends_only_their_tasks_and_the_evaluation_reports_the_rest(
    tmp_path: Path, tiny_model: Path, run_factory
) -> None:
    """The reward raises on one prompt in ten (index ending in 3) and returns NaN for prompt 8: only
    those rows' tasks end dead, each with its reason; the other rows of their messages train; and
    every evaluation reports the rows it scored with the count it could not (3 of 20 held out).
    max_staleness 1: a message split over two steps mostly trains whole (with 0 its leftover is
    always surplus)."""
    cfg = fault_config(tmp_path / "run", tiny_model, run={"eval_every": 4}, flow={"max_staleness": 1},
                       task={"reward_fn": "tests.faults.chaos_rewards:bad_rows", "eval_size": 20})
    run = run_factory(cfg)
    run.finish()
    RECOVERY.append(("reward raises on 1 row in 10, NaN on another", 0.0))
    tasks = _journal_tasks(cfg)
    dead = {t.task_id: t for t in tasks if t.state == "dead"}
    bad = {t.task_id for t in tasks if t.dataset_index % 10 == 3 or t.dataset_index == 8}
    assert bad and set(dead) == bad, f"dead {sorted(dead)}, expected exactly {sorted(bad)}"
    for t in dead.values():
        i = t.dataset_index
        want = "non_finite_reward: reward 'bad_rows' returned a non-finite reward nan" if i == 8 else (
            f"reward_error: reward 'bad_rows' raised ValueError: cannot score prompt {i} (on prompt {i})")
        assert (t.reason or "").startswith(want), t.reason
    # The other prompts of a bad row's message train; only where a step split their message and the
    # leftover would be past flow.max_staleness is it dropped as surplus (the audit verified that).
    mates = [t for t in tasks if t.task_id not in bad and any(d.dataset_index // 4 == t.dataset_index // 4
                                                             for d in dead.values())]
    assert mates and all(t.state == "trained" or (t.state == "dropped" and (t.reason or "").startswith("surplus:"))
                         for t in mates), [(t.task_id, t.state, t.reason) for t in mates if t.state != "trained"]
    assert sum(t.state == "trained" for t in mates) * 2 >= len(mates)
    assert run.fleet.procs["reward"].restarts == 0
    rows = {r["step"]: r for r in read_metrics(cfg.run_dir / "metrics.jsonl")}
    for step, suffix in ((1, "_before"), (4, ""), (8, "")):
        got = {k: rows[step].get(f"eval_{k}{suffix}") for k in ("unscored", "unscored_greedy", "reward")}
        assert got["unscored"] == got["unscored_greedy"] == 3.0 and got["reward"] is not None, (step, got)


def test_a_hanging_reward_times_out_with_its_reason_and_the_run_goes_on(
    tmp_path: Path, tiny_model: Path, run_factory
) -> None:
    """The reward never returns for prompt 5: its batch's tasks end dead `reward_timeout` after
    task.reward_timeout_s, the reward's process is replaced (not the service), the run completes,
    and the evaluation (whose held-out prompt 5 hangs too) counts its rows unscored instead of
    stalling the step."""
    cfg = fault_config(tmp_path / "run", tiny_model, run={"max_steps": 4, "eval_every": 0},
                       task={"reward_fn": "tests.faults.chaos_rewards:hangs_on_index_5", "eval_size": 8,
                             "reward_timeout_s": 1.5})
    run = run_factory(cfg)
    run.finish()
    dead = [t for t in _journal_tasks(cfg) if t.state == "dead"]
    assert sorted({t.dataset_index for t in dead}) == [4, 5, 6, 7], "only the hung batch's tasks end dead"
    assert all((t.reason or "").startswith("reward_timeout: the reward did not return within"
                                           " task.reward_timeout_s (1.5s)") for t in dead), dead[0].reason
    assert run.fleet.procs["reward"].restarts == 0
    assert "reward process stopped; restarting it" in (cfg.run_dir / "logs" / "reward.log").read_text()
    rows = {r["step"]: r for r in read_metrics(cfg.run_dir / "metrics.jsonl")}
    for step, suffix in ((1, "_before"), (4, "")):
        assert rows[step].get(f"eval_unscored{suffix}") == rows[step].get(f"eval_unscored_greedy{suffix}") == 8.0
        assert f"eval_reward{suffix}" not in rows[step]


def test_lmdb_on_a_full_filesystem_pauses_and_resumes(tmp_path: Path, tiny_model: Path, run_factory) -> None:
    mnt = tmp_path / "jfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        cfg = fault_config(tmp_path / "run", tiny_model,
                           journal={"dir": str(mnt / "journal"), "min_free_bytes": 512 * 1024})
        run = run_factory(cfg)
        filler = mnt / "filler"
        port = run.fleet.cfg.endpoint("controller").http_port  # type: ignore[union-attr]
        import httpx

        def fill_then_free() -> None:
            with filler.open("wb") as f:
                try:
                    while True:
                        f.write(b"\x00" * 65536)
                except OSError:
                    pass
            deadline = time.monotonic() + 30
            ready = 200
            while time.monotonic() < deadline:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code
                if ready == 503:
                    break
                time.sleep(0.2)
            assert ready == 503, "controller stayed ready on a full disk"
            time.sleep(2.0)
            filler.unlink()

        run.fault("LMDB on a full filesystem", fill_then_free)
        run.finish()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# One run for the faults below: one fleet start (~14 s on 2 cores: three processes import torch)
# instead of seven. Its steps: the run goes on between faults at several steps a second, and the
# faults' own waits (reclaim, resend, restarts) are fixed seconds, so a faster host spends more steps
# on them: the faults before the last took 89 steps on a loaded 2-core host, and 200 leaves room for
# one twice as fast (each test fails at once, naming this, when too few are left); the last kills
# every service in turn with 12 steps each. What is left over after it costs ~0.15 s a step.
SHARED_STEPS = 200 + 12 * len(KILLED)


@pytest.fixture(scope="class")
def shared_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Run]:
    """The default fault config, with a 256 KiB message limit (for the oversized message) and a
    64 KiB journal map (which must grow) that change nothing for the other faults."""
    cfg = fault_config(tmp_path_factory.mktemp("shared") / "run", tiny_model, run={"max_steps": SHARED_STEPS},
                       flow={"max_message_bytes": 256 * 1024}, journal={"map_size_bytes": 64 * 1024})
    fleet = Fleet(cfg, restart_budget=3)
    try:
        yield Run(fleet, cfg, timeout_s=600)  # every test of the class in one run
    finally:
        fleet.stop(grace_s=10)


def _changed(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


class TestOneFleet:
    """Faults injected one after another into one run, each only once the previous one healed (the
    next step completed and its own checks passed), in the order they are written: pytest keeps
    it. Each asserts its outcome on what changed while it ran (restarts, dead letters, versions);
    the last one ends the run, whose every step and `rlfleet audit` then cover all of them. A fault
    that broke the fleet fails the tests after it too, but the first failure names it."""

    def test_bad_messages_are_dead_lettered_with_named_reasons(self, shared_run: Run) -> None:
        run, cfg = shared_run, shared_run.cfg
        run.expect_steps_left(4)
        assert run.fleet.redis is not None
        r = redis.Redis(port=run.fleet.redis.port)

        def inject() -> None:
            r.xadd(_stream(cfg, "rollouts"), {"data": b"\x0a\xff\xff\xff\xff\x0f garbage", "kind": "rollout",
                                               "batch_id": "b999999:bad"})
            r.xadd(_stream(cfg, "rollouts"), {"data": b"\x00" * (cfg.flow.max_message_bytes + 1), "kind": "rollout",
                                               "batch_id": "b999998:big"})
            wrong = pb.RolloutBatch(schema_version=1, batch_id="b999997:shape", task_ids=["t999997-0", "t999997-1"])
            for field, dtype, shape in (("prompt_ids", "int64", [2, 3]), ("prompt_mask", "bool", [2, 3]),
                                        ("response_ids", "int64", [2, 2]), ("response_mask", "bool", [2, 2]),
                                        ("behaviour_logprobs", "float32", [2, 5]), ("group_ids", "int64", [2])):
                t = getattr(wrong, field)
                t.dtype, t.shape[:] = dtype, shape
                n = 1
                for d in shape:
                    n *= d
                t.data = b"\x00" * (n * {"int64": 8, "bool": 1, "float32": 4}[dtype])
            r.xadd(_stream(cfg, "rollouts"), {"data": wrong.SerializeToString(), "kind": "rollout",
                                               "batch_id": "b999997:shape"})
            future = pb.PromptBatch(schema_version=99, batch_id="b999996")
            r.xadd(_stream(cfg, "prompts"), {"data": future.SerializeToString(), "kind": "prompts",
                                              "batch_id": "b999996"})
            rows = cfg.batch.prompts_per_message * cfg.algo.group_size
            nan = pb.ScoreBatch(schema_version=1, batch_id="b999995:nan", stage="reward",
                                task_ids=[f"t{999995 + i // 2}-{i % 2}" for i in range(rows)])
            nan.rewards.dtype, nan.rewards.shape[:] = "float32", [rows]
            nan.rewards.data = b"\x00\x00\xc0\x7f" * rows  # float32 NaN
            r.xadd(_stream(cfg, "scores"), {"data": nan.SerializeToString(), "kind": "score",
                                             "batch_id": "b999995:nan"})

        named = ("malformed", "oversized", "shape_mismatch", "schema_version", "non_finite")
        run.fault("malformed, oversized, wrong shape, schema, NaN score", inject, at_step=run.step() + 1)
        # On its own run this was checked once the run had ended, a few steps on: as many steps here.
        wait_for_step(run.fleet, run.step() + 4)
        deadline = time.monotonic() + 60
        while True:
            reasons = [e[1][b"reason"].decode() for e in r.xrange(_stream(cfg, "dead"))]
            missing = [n for n in named if not any(n in x for x in reasons)]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for n in named:
            assert any(n in x for x in reasons), f"no dead letter for {n}: {reasons}"

    def test_sigstop_past_reclaim_then_sigcont_counts_once(self, shared_run: Run, tmp_path: Path) -> None:
        """A stalled reward consumer's pending entries are reclaimed by a second replica; when it
        wakes up its late score is a duplicate the controller ignores (the run's audit: exactly once)."""
        run, cfg = shared_run, shared_run.cfg
        run.expect_steps_left(4)
        assert run.fleet.cfg is not None
        replica_cfg = run.fleet.cfg.model_dump(mode="json")
        replica_cfg["services"]["reward"].update(grpc_port=0, http_port=0)
        replica_cfg["run"]["dir"] = str(tmp_path / "replica")
        path = tmp_path / "replica.yaml"
        path.write_text(yaml.safe_dump(replica_cfg))
        log = (tmp_path / "replica.log").open("wb")
        replica = subprocess.Popen([sys.executable, "-m", "services.reward", "--config", str(path)],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            state_file = tmp_path / "replica" / "services" / "reward.json"
            deadline = time.monotonic() + 90
            while not (state_file.exists() and json.loads(state_file.read_text()).get("state") == "ready"):
                assert replica.poll() is None, "the second reward replica exited"
                assert time.monotonic() < deadline, "the second reward replica never became ready"
                time.sleep(0.2)
            victim = run.fleet.procs["reward"].proc.pid

            def stall() -> None:
                os.kill(victim, signal.SIGSTOP)
                time.sleep(3 * cfg.flow.reclaim_idle_ms / 1000)
                os.kill(victim, signal.SIGCONT)

            run.fault("SIGSTOP reward past reclaim, SIGCONT", stall, at_step=run.step() + 1)
            wait_for_step(run.fleet, run.step() + 4)
            assert json.loads(state_file.read_text())["pid"] == replica.pid
        finally:
            replica.terminate()
            replica.wait(timeout=30)
            log.close()

    def test_hot_swap_critic_under_load(self, shared_run: Run) -> None:
        run, cfg = shared_run, shared_run.cfg
        run.expect_steps_left(4)
        before = run.restarts()
        old = run.fleet.procs["critic"].proc.pid
        timings: dict[str, float] = {}
        run.fault("hot swap critic", lambda: timings.update(swap(cfg.run_dir, "critic", timeout_s=120)),
                  at_step=run.step() + 1)
        wait_for_step(run.fleet, run.step() + 4)
        assert run.fleet.procs["critic"].proc.pid != old, "the drained critic was replaced"
        assert run.fleet.procs["critic"].restarts == before["critic"], \
            "a drained service is replaced, not counted as a crash"
        served = [json.loads(x) for x in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
        critic = [e["version"] for e in served if e["kind"] == "version_served" and e["service"] == "critic"]
        assert critic == sorted(critic), f"critic versions went backwards: {critic}"

    @pytest.mark.parametrize("empty", [False, True], ids=["aof", "empty"])
    def test_redis_kill9_and_restart(self, empty: bool, shared_run: Run) -> None:
        run = shared_run
        run.expect_steps_left(4)
        before = run.restarts()
        name = "redis restarted empty" if empty else "redis kill -9, AOF restart"
        run.fault(name, _restart_redis(run.fleet, empty), at_step=run.step() + 1)
        # On its own run, a crash was looked for until the run ended, a few steps on: as many here.
        wait_for_step(run.fleet, run.step() + 4)
        restarted = _changed(before, run.restarts())
        assert not restarted, f"services crashed on a Redis outage instead of waiting: {restarted}"

    def test_lmdb_map_full_grows_and_the_run_goes_on(self, shared_run: Run) -> None:
        """The journal's map starts at 64 KiB: the run is past it (and goes on to its end in the
        last test of this class)."""
        run, cfg = shared_run, shared_run.cfg
        run.expect_steps_left(1)
        wait_for_step(run.fleet, max(8, run.step() + 1))
        assert (cfg.journal_dir / "data.mdb").stat().st_size > 64 * 1024

    def test_kill9_of_each_service_mid_step_recovers_without_loss(self, shared_run: Run) -> None:
        """Every service killed in turn mid-run; the next one only once the previous victim's
        replacement is ready, so each recovery is its own. Last: it ends the shared run, and the
        run's every step and audit cover the faults before it too."""
        # Steps take a fraction of a second and the pipeline runs ahead of a restarting scorer, so
        # the run must have enough steps left to outlast five restarts.
        run = shared_run
        run.expect_steps_left(12 * len(KILLED))
        before = run.restarts()
        old = {name: run.fleet.procs[name].proc.pid for name in KILLED}
        for service in KILLED:
            run.expect_steps_left(2)
            run.fault(f"kill -9 {service}", kill9(run.fleet, service), at_step=run.step() + 1)
            deadline = time.monotonic() + 120
            while not (run.fleet.procs[service].restarts == before[service] + 1 and _ready(run.fleet, service)):
                assert time.monotonic() < deadline, f"{service} not back within 120s (supervise: {run.result!r})"
                time.sleep(0.1)
        run.finish()
        for service in KILLED:
            assert run.fleet.procs[service].proc.pid != old[service], f"the supervisor restarted {service}"
        assert _changed(before, run.restarts()) == dict.fromkeys(KILLED, 1)
