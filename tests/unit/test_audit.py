"""`rlfleet audit`: each of the five journal invariants is checked against a real journal and a real
event log, a clean run passes, and every injected violation is caught and named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.audit import EXIT_ERROR, EXIT_OK, EXIT_VIOLATION, AuditReport, audit, audit_main, stream_class
from services.core.config.run import parse_config
from services.core.journal.journal import Journal, TaskSpec
from services.core.observability.events import EventLog

REPO = Path(__file__).resolve().parents[2]
PROMPTS_PER_STEP = 2
GROUP = 2
SAMPLES_PER_STEP = PROMPTS_PER_STEP * GROUP  # 4
MAX_STALENESS = 1
STREAM_CAPACITY = 8
# Bounds the audit derives from that config (see services.audit.limits):
CEILING = (MAX_STALENESS + 1) * SAMPLES_PER_STEP  # 8 tasks in flight at most
ROLLOUTS_LIMIT = STREAM_CAPACITY + CEILING  # 16


class Run:
    """Drives a real journal and a real event log the way the controller does: journal first,
    event second."""

    def __init__(self, root: Path, *, max_steps: int = 3, fleet_yaml: bool = True) -> None:
        self.dir = root / "run"
        self.dir.mkdir(parents=True)
        cfg = parse_config(
            {
                "run": {"name": "audit-test", "dir": str(self.dir), "max_steps": max_steps},
                "algo": {"name": "grpo", "group_size": GROUP},
                "batch": {"prompts_per_step": PROMPTS_PER_STEP, "prompts_per_message": 1},
                "flow": {"max_staleness": MAX_STALENESS, "stream_capacity": STREAM_CAPACITY},
            }
        )
        if fleet_yaml:
            (self.dir / "fleet.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        # sync off: these tests are about bookkeeping, not power loss; keeps the file fast.
        self.j: Journal | None = Journal.open(
            self.dir / "journal", sync=False, metasync=False, stages=cfg.stages(), trainable=("actor",)
        )
        self.ev = EventLog(self.dir / "events.jsonl", fsync=False)
        self.version = 0
        self.step = 0
        self.prompt = 0

    @property
    def journal(self) -> Journal:
        assert self.j is not None
        return self.j

    def admit(self, prompts: int = PROMPTS_PER_STEP) -> list[str]:
        specs = [
            TaskSpec(f"p{d}-s{k}", dataset_index=d, sample_index=k, group_id=d)
            for d in range(self.prompt, self.prompt + prompts)
            for k in range(GROUP)
        ]
        self.prompt += prompts
        self.journal.admit(specs, cursor=self.prompt)
        ids = [s.task_id for s in specs]
        self.ev.emit("admitted", task_ids=ids, cursor=self.prompt)
        return ids

    def generate(self, ids: list[str], version: int | None = None) -> None:
        v = self.version if version is None else version
        self.journal.mark_generated(ids, v, batch_id=f"b{ids[0]}")
        self.ev.emit("generated", task_ids=ids, version=v)

    def score(self, ids: list[str]) -> None:
        self.journal.mark_stage_done(ids, "reward")
        self.ev.emit("scored", task_ids=ids)

    def train(self, ids: list[str], *, step: int | None = None, journal_max_staleness: int = MAX_STALENESS) -> None:
        step = self.step + 1 if step is None else step
        gvs = []
        for t in ids:
            rec = self.journal.get(t)
            assert rec is not None and rec.generated_version is not None
            gvs.append(rec.generated_version)
        self.journal.mark_trained(ids, step, self.version, journal_max_staleness, batch=b"batch-%d" % step)
        self.ev.emit("trained", step=step, task_ids=ids, version=self.version, generated_versions=gvs)
        self.step = step
        self.version += 1
        self.journal.set_version("actor", self.version)
        self.ev.emit("version_served", service="actor", version=self.version)
        with (self.dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "reward_mean": 0.5}) + "\n")

    def full_step(self) -> list[str]:
        ids = self.admit()
        self.generate(ids)
        self.score(ids)
        self.train(ids)
        return ids

    def checkpoint(self) -> None:
        self.journal.prune_batches("actor", self.step)
        self.ev.emit("checkpoint", service="actor", version=self.version, step=self.step)

    def resources(self, **depths: int) -> None:
        q = {"prompts": 2, "rollouts": 3, "scores": 1, "dead": 0} | depths
        self.ev.emit(
            "resources", queue_depths=q, rss_bytes={"controller": 100 << 20, "actor": 900 << 20}, disk_bytes=5 << 20
        )

    def close(self) -> None:
        self.ev.close()
        if self.j is not None:
            self.j.close()  # one LMDB handle per process: the audit opens its own
            self.j = None

    def audit(self, **kw: Any) -> AuditReport:
        self.close()
        return audit(self.dir, **kw)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp_path)
    try:
        yield r
    finally:
        r.close()


def clean(r: Run) -> None:
    """Three steps with overlap (step 2's tasks generated one version behind), a checkpoint, one dead
    task, resources in bounds."""
    r.ev.emit("version_served", service="actor", version=0)
    r.full_step()
    r.resources()
    late = r.admit()
    r.generate(late)  # at version 1
    step2 = r.admit()
    r.generate(step2)
    r.score(step2)
    r.train(step2)  # version 1 trains tasks from version 1: lag 0
    r.checkpoint()
    r.score(late)
    r.train(late)  # version 2 trains tasks from version 1: lag 1 == max_staleness
    poison = r.admit(1)
    r.journal.mark_dead(poison, "poison message: 3 deliveries")
    for t in poison:
        r.ev.emit("dead", task_id=t, reason="poison message: 3 deliveries")
    r.resources(rollouts=ROLLOUTS_LIMIT)  # exactly at the bound is fine


def failed(report: AuditReport) -> dict[int, dict[str, int]]:
    return {c.number: dict(c.violations) for c in report.checks if not c.passed}


# -- a clean run -----------------------------------------------------------------------------------


def test_clean_finished_run_passes_every_invariant(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    clean(run)
    run.close()
    assert audit_main(run.dir) == EXIT_OK
    out = capsys.readouterr().out
    for n, name in enumerate(
        ["no loss", "exactly-once effect", "bounded staleness", "monotonic versions", "bounded resources"], 1
    ):
        assert f"PASS  {n}. {name}" in out
    assert "RESULT: PASS" in out
    assert "journal step 3 >= run.max_steps 3" in out
    assert "'poison message: 3 deliveries': 2" in out  # dead reasons histogram
    assert "torn last line: no" in out

    report = audit(run.dir)
    assert report.ok and report.finished
    assert report.tasks_by_state == {"admitted": 0, "generated": 0, "scored": 0, "trained": 12, "dead": 2, "dropped": 0}
    assert report.steps == {"journal": 3, "trained events": 3, "metrics": 3, "run.max_steps": 3}
    assert report.check(3).stats["staleness histogram"] == {0: 8, 1: 4}
    assert report.limits.queue_limit("rollouts") == ROLLOUTS_LIMIT
    assert report.warnings == []


def test_json_output_is_machine_readable(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    clean(run)
    run.close()
    assert audit_main(run.dir, json_out=True) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    assert [c["passed"] for c in doc["checks"]] == [True] * 5
    assert doc["limits"]["in_flight_ceiling"] == CEILING


# -- each invariant, violated --------------------------------------------------------------------


def test_lost_task_in_a_finished_run_fails_no_loss(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    clean(run)
    stuck = run.admit(1)
    run.generate(stuck)  # admitted and generated, never trained nor dead; the run is over
    run.close()
    assert audit_main(run.dir) == EXIT_VIOLATION
    out = capsys.readouterr().out
    assert "FAIL  1. no loss: 2 violations (lost 2)" in out
    assert f"lost: task {stuck[0]!r} is still generated" in out
    assert failed(audit(run.dir)) == {1: {"lost": 2}}


def test_trained_twice_fails_exactly_once(run: Run) -> None:
    clean(run)
    first = run.journal.get("p0-s0")
    assert first is not None and first.trained_step == 1
    # A buggy controller counts p0-s0 again in a later step (the journal would refuse; the log shows it).
    step4 = run.admit()
    run.generate(step4)
    run.score(step4)
    run.train(step4)
    run.ev.emit("trained", step=5, task_ids=["p0-s0"], version=run.version, generated_versions=[0])
    run.ev.emit("trained", step=6, task_ids=["p1-s0", "p1-s0"], version=run.version, generated_versions=[0, 0])
    report = run.audit()
    c2 = report.check(2)
    assert c2.violations["trained_twice"] == 2  # p0-s0 in steps 1 and 5; p1-s0 in steps 1 and 6
    assert c2.violations["duplicate_in_step"] == 1
    assert "trained_twice: task 'p0-s0' in trained events of step 1 and step 5" in report.render()
    assert report.exit_code == EXIT_VIOLATION


def test_staleness_beyond_the_bound_fails_bounded_staleness(run: Run) -> None:
    run.full_step()  # trains version 0 -> serves 1
    stale = run.admit()
    run.generate(stale, version=0)  # generated by version 0 ...
    run.full_step()
    run.full_step()  # ... while the policy moved on to version 3
    run.score(stale)
    # The controller used the wrong bound (3 instead of the run's 1), so the journal accepted it.
    run.train(stale, journal_max_staleness=3)
    report = run.audit(finished=True)
    assert failed(report) == {3: {"stale": len(stale)}}
    assert "staleness 3 > max_staleness 1" in report.render()
    assert report.check(3).stats["max staleness"] == 3


def test_stale_trained_event_is_caught_even_when_the_journal_disagrees(run: Run) -> None:
    ids = run.full_step()
    # A second trained event for a task, 4 versions after it was generated: counted twice AND stale.
    run.ev.emit("trained", step=2, task_ids=ids[:1], version=4, generated_versions=[0])
    report = run.audit(finished=False)
    assert report.check(3).violations["stale"] == 1
    assert report.check(2).violations["trained_twice"] == 1


def test_version_going_backwards_fails_monotonic_versions(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    clean(run)
    # The actor restarted from an old checkpoint and served version 1 after version 3.
    run.ev.emit("version_served", service="actor", version=1)
    run.close()
    assert audit_main(run.dir) == EXIT_VIOLATION
    out = capsys.readouterr().out
    assert "FAIL  4. monotonic versions" in out
    assert "version_backwards: actor served version 1 after serving version 3" in out
    assert failed(audit(run.dir)) == {4: {"version_backwards": 1}}


def test_serving_below_a_reported_checkpoint_fails(run: Run) -> None:
    run.full_step()
    run.full_step()
    run.checkpoint()  # actor checkpointed version 2
    # A fresh replica (new key) that loads an older checkpoint is still below the service's checkpoint
    run.ev.emit("checkpoint", service="critic", version=5, step=2)
    run.ev.emit("version_served", service="critic", version=4)
    report = run.audit(finished=False)
    assert failed(report) == {4: {"below_checkpoint": 1}}


def test_served_version_the_journal_never_acknowledged_fails(run: Run) -> None:
    run.full_step()
    run.ev.emit("version_served", service="actor", version=7)  # journal says actor is at 1
    report = run.audit(finished=False)
    assert failed(report) == {4: {"served_unacknowledged": 1}}


def test_step_gap_fails_monotonic_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = Run(tmp_path, max_steps=3)
    first = r.admit()
    r.generate(first)
    r.score(first)
    r.train(first, step=1)
    second = r.admit()
    r.generate(second)
    r.score(second)
    r.train(second, step=3)  # the journal allows a jump; step 2 never happened
    r.close()
    assert audit_main(r.dir) == EXIT_VIOLATION
    out = capsys.readouterr().out
    assert "step_gap: step 2 missing: no trained event and no journal task trained in it" in out
    assert failed(audit(r.dir)) == {4: {"step_gap": 1}}


def test_repeated_step_in_the_log_fails(run: Run) -> None:
    run.full_step()
    run.ev.emit("trained", step=1, task_ids=[], version=0, generated_versions=[])
    report = run.audit(finished=False)
    assert failed(report) == {2: {"partial_batch": 1}, 4: {"step_repeat": 1}}  # an empty step is no full batch


def test_queue_depth_over_the_bound_fails_bounded_resources(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    clean(run)
    run.resources(rollouts=ROLLOUTS_LIMIT + 1)
    run.ev.emit("resources", queue_depths={"rlfleet:audit-test:prompts": CEILING + 5}, rss_bytes=1, disk_bytes=1)
    run.close()
    assert audit_main(run.dir) == EXIT_VIOLATION
    out = capsys.readouterr().out
    assert "FAIL  5. bounded resources: 2 violations (queue_over_limit 2)" in out
    assert f"queue_over_limit: rollouts depth {ROLLOUTS_LIMIT + 1} > {ROLLOUTS_LIMIT}" in out
    assert f"rlfleet:audit-test:prompts depth {CEILING + 5} > {CEILING}" in out
    assert f"rollouts: {ROLLOUTS_LIMIT + 1} (limit {ROLLOUTS_LIMIT})" in out  # maxima reported


def test_rss_and_disk_limits_apply_only_when_given(run: Run) -> None:
    clean(run)
    run.close()
    assert audit(run.dir).ok  # no rss/disk limits by default
    report = audit(run.dir, limits={"rss_bytes": {"actor": 512 << 20}, "disk_bytes": 1 << 20})
    assert failed(report) == {5: {"rss_over_limit": 2, "disk_over_limit": 2}}
    assert audit(run.dir, limits={"rss_bytes": 1 << 30, "disk_bytes": 1 << 30}).ok


def test_admission_overshoot_replayed_from_events_fails(run: Run) -> None:
    for _ in range(3):  # 12 tasks admitted, none finished: above the admission window of 8
        run.admit()
    report = run.audit(finished=False)
    assert failed(report) == {5: {"in_flight_over_limit": 1}}
    assert report.check(5).stats["max in flight"] == f"12 (ceiling {CEILING})"


def test_disk_usage_shaped_like_journal_usage_counts_the_file_only(run: Run) -> None:
    clean(run)
    usage = run.journal.usage()  # what the controller puts in disk_bytes
    run.ev.emit("resources", queue_depths={}, rss_bytes=1, disk_bytes=usage)
    run.close()
    limit = usage["file_bytes"]  # map_size (address space) and free space must not count
    report = audit(run.dir, limits={"disk_bytes": max(limit, 5 << 20)})
    assert report.ok
    assert report.check(5).stats["min disk free bytes"] == usage["disk_free_bytes"]
    over = audit(run.dir, limits={"disk_bytes": limit - 1}).check(5)
    assert any(f"disk {limit} bytes > {limit - 1}" in ex for ex in over.examples)


# -- a run still going -------------------------------------------------------------------------


def test_running_run_with_tasks_in_flight_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = Run(tmp_path, max_steps=10)
    r.full_step()
    r.full_step()
    waiting = r.admit()
    r.generate(waiting)
    scored_ids = r.admit()
    r.generate(scored_ids)
    r.score(scored_ids)
    r.resources()
    r.close()
    assert audit_main(r.dir) == EXIT_OK
    out = capsys.readouterr().out
    assert "run: still running (auto-detected: journal step 2 < run.max_steps 10" in out
    assert "8 task(s) in flight (allowed: the run is still going)" in out
    # Told it is finished, the same journal has lost tasks.
    assert failed(audit(r.dir, finished=True)) == {1: {"lost": 8}}


def test_run_finished_event_marks_a_run_finished(tmp_path: Path) -> None:
    r = Run(tmp_path, max_steps=10)
    r.full_step()
    r.admit()
    r.ev.close()
    with EventLog(r.dir / "events.jsonl", fsync=False, validate_kinds=False) as log:
        log.emit("run_finished", step=1)
    report = r.audit()
    assert report.finished and "run_finished event" in report.finished_reason
    assert failed(report) == {1: {"lost": GROUP * PROMPTS_PER_STEP}}


def test_task_in_the_log_but_not_in_the_journal_is_lost_even_while_running(tmp_path: Path) -> None:
    r = Run(tmp_path, max_steps=10)
    r.full_step()
    r.ev.emit("admitted", task_ids=["ghost"], cursor=99)
    report = r.audit()
    assert not report.finished
    assert failed(report) == {1: {"missing_from_journal": 1}}


def test_dead_event_the_journal_does_not_hold_fails_no_loss(tmp_path: Path) -> None:
    r = Run(tmp_path, max_steps=10)
    ids = r.admit()
    r.ev.emit("dead", task_id=ids[0], reason="")
    report = r.audit()
    assert failed(report) == {1: {"dead_without_reason": 1, "dead_mismatch": 1}}


# -- the run directory itself --------------------------------------------------------------------


def test_missing_journal_is_a_clear_error_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    assert audit_main(tmp_path / "run") == EXIT_ERROR
    err = capsys.readouterr().err
    assert "no journal at" in err and "missing directory" in err
    assert audit_main(tmp_path / "nowhere") == EXIT_ERROR
    assert "does not exist" in capsys.readouterr().err


def test_unknown_limit_is_an_error(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    run.close()
    assert audit_main(run.dir, limits={"rss_byte": 1}) == EXIT_ERROR
    assert "unknown limits ['rss_byte']" in capsys.readouterr().err


def test_torn_last_line_is_reported_not_a_violation(run: Run) -> None:
    clean(run)
    run.close()
    with (run.dir / "events.jsonl").open("ab") as f:
        f.write(b'{"ts": 1.0, "kind": "trained", "step": 4, "task_')  # the controller died mid-write
    report = audit(run.dir)
    assert report.ok
    assert report.event_log["torn_last_line"] is True
    assert "torn last line: yes (skipped; not a violation)" in report.render()


def test_without_fleet_yaml_limits_and_defaults_are_used_and_said(tmp_path: Path) -> None:
    r = Run(tmp_path, fleet_yaml=False)
    r.full_step()
    r.close()
    report = audit(r.dir, limits={"max_staleness": 0, "max_steps": 1, "samples_per_step": SAMPLES_PER_STEP})
    assert report.ok and report.finished
    assert "no fleet.yaml" in report.limits.source and "stream_capacity" in report.limits.source
    assert any("fleet.yaml not found" in w for w in report.warnings)


def test_a_limit_contradicting_fleet_yaml_is_ignored_with_a_warning(run: Run) -> None:
    clean(run)
    run.close()
    report = audit(run.dir, limits={"max_staleness": 0})
    assert report.ok and report.limits.max_staleness == MAX_STALENESS
    assert any("limits['max_staleness']=0 ignored" in w for w in report.warnings)


def test_lost_events_after_a_crash_are_warnings_not_violations(run: Run) -> None:
    run.full_step()
    ids = run.admit()
    run.generate(ids)
    run.score(ids)
    # Crash between the journal commit and the event: step 2 is in the journal only.
    run.journal.mark_trained(ids, 2, run.version, MAX_STALENESS, batch=b"b2")
    report = run.audit(finished=False)
    assert report.ok
    assert any("no trained event" in w for w in report.warnings)


def test_a_drop_journaled_but_not_logged_before_a_crash_does_not_count_as_in_flight(run: Run) -> None:
    # Two steps' worth in flight (the window); one group is dropped in the journal, the controller
    # dies before its event, and the replacement admits one more group in the freed room.
    first, second = run.admit(), run.admit()
    for ids in (first, second):
        run.generate(ids)
        run.score(ids)
    run.journal.mark_dropped(first[:GROUP], "surplus: its step was full", step=MAX_STALENESS + 1, kind="surplus")
    run.admit(1)
    report = run.audit(finished=False)
    assert report.ok, report.render()
    assert report.check(5).stats["max in flight"] == f"{CEILING + GROUP} (ceiling {CEILING})"
    assert f"{GROUP} dropped journal task(s) have no dropped event" in report.warnings
    assert any("the log misses terminal events the journal has" in w for w in report.warnings)


def test_replay_batch_missing_after_the_oldest_checkpoint_fails(tmp_path: Path) -> None:
    r = Run(tmp_path, max_steps=10)
    r.full_step()
    ids = r.admit()
    r.generate(ids)
    r.score(ids)
    r.journal.mark_trained(ids, 2, r.version, MAX_STALENESS)  # no batch stored for step 2
    r.ev.emit("trained", step=2, task_ids=ids, version=r.version, generated_versions=[1] * len(ids))
    report = r.audit()
    assert failed(report) == {4: {"replay_gap": 1}}


def test_an_open_journal_handle_can_be_passed_in(run: Run) -> None:
    clean(run)
    run.ev.close()
    report = audit(run.dir, journal=run.journal)  # in-process caller already holds the only handle
    assert report.ok
    assert run.journal.step == 3  # still open and usable


@pytest.mark.parametrize(
    ("key", "cls"),
    [
        ("prompts", "prompts"),
        ("rlfleet:r:rollouts", "rollouts"),
        ("rollouts:critic", "rollouts"),
        ("queue_scores", "scores"),
        ("rlfleet:r:dead", "dead"),
        ("outbox", "other"),
    ],
)
def test_stream_names_are_classified_by_segment(key: str, cls: str) -> None:
    assert stream_class(key) == cls


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"max_staleness": -1}, "limits['max_staleness'] must be a non-negative integer, got -1"),
        ({"disk_bytes": True}, "limits['disk_bytes'] must be a non-negative integer, got True"),
        ({"queue_headroom": 0}, "limits['queue_headroom'] must be a positive number, got 0"),
        ({"rss_bytes": {"actor": 1.5}}, "limits['rss_bytes'] must be a non-negative integer or a dict service"),
        ({"stages": 5}, "limits['stages'] must be a list of stage names, got 5"),
    ],
)
def test_a_bad_limit_value_is_one_line_naming_it_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limits: dict[str, Any], message: str
) -> None:
    r = Run(tmp_path, fleet_yaml=False)  # without fleet.yaml the config limits come from the caller
    r.full_step()
    r.close()
    assert audit_main(r.dir, limits=limits) == EXIT_ERROR
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_python_dash_m_services_audit_is_the_audit_command(run: Run) -> None:
    clean(run)
    run.close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run(
        [sys.executable, "-m", "services.audit", "--run-dir", str(run.dir)], capture_output=True, text=True, env=env
    )
    assert ok.returncode == EXIT_OK, ok.stderr
    assert "RESULT: PASS (all five invariants hold)" in ok.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "services.audit", "--run-dir", str(run.dir), "--json", "--running"],
        capture_output=True, text=True, env=env,
    )
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is True and doc["finished_reason"] == "as told by the caller" and doc["finished"] is False
    gone = subprocess.run(
        [sys.executable, "-m", "services.audit", "--run-dir", str(run.dir / "nowhere")],
        capture_output=True, text=True, env=env,
    )
    assert gone.returncode == EXIT_ERROR
    assert gone.stderr.strip().splitlines() == [f"rlfleet audit: run directory {run.dir / 'nowhere'} does not exist"]


@pytest.mark.parametrize(("left_for", "ok"), [(1, False), (3, True)])
def test_a_surplus_drop_is_valid_when_too_stale_or_left_when_the_last_step_was_in(run: Run, left_for: int,
                                                                                  ok: bool) -> None:
    # Generated at version 0 and left for the step training version 1: that step could have trained it.
    # Left when journal step 3 = run.max_steps was in, no step will: the run's end drops it.
    ids = run.admit()
    run.generate(ids)
    run.score(ids)
    run.journal.mark_dropped(ids[:GROUP], "surplus: its step was full", step=left_for, kind="surplus")
    report = run.audit(finished=False)
    assert ("surplus_not_stale" not in failed(report).get(1, {})) is ok, report.render()
