"""The controller's task journal: state machine, invariants, atomicity, and full-disk behaviour."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import services.core.journal.journal as journal_mod
from services.core.config.run import RunConfig, parse_config
from services.core.journal.journal import (
    ExactlyOnceError,
    Journal,
    JournalError,
    JournalFull,
    StalenessError,
    TaskSpec,
    TaskState,
    check_staleness,
)
from services.core.journal.run_binding import RUN_ID_FILE, RunBindingError, open_run_journal

REPO = Path(__file__).resolve().parents[2]
KiB = 1024


def specs(first_prompt: int, prompts: int, group: int = 2) -> list[TaskSpec]:
    """`prompts` prompts from dataset index `first_prompt`, `group` samples each."""
    return [
        TaskSpec(f"p{d}-s{k}", dataset_index=d, sample_index=k, group_id=d)
        for d in range(first_prompt, first_prompt + prompts)
        for k in range(group)
    ]


def ids(tasks: list[TaskSpec]) -> list[str]:
    return [t.task_id for t in tasks]


@pytest.fixture
def j(tmp_path: Path) -> Iterator[Journal]:
    jr = Journal.open(tmp_path / "journal", stages=("reward",), trainable=("actor",))
    try:
        yield jr
    finally:
        jr.close()


def scored(jr: Journal, tasks: list[TaskSpec], version: int = 0, cursor: int | None = None) -> list[str]:
    """Admit, generate under `version` and score `tasks`; returns their ids."""
    jr.admit(tasks, cursor=cursor if cursor is not None else max(t.dataset_index for t in tasks) + 1)
    jr.mark_generated(ids(tasks), version=version, batch_id="b0")
    jr.mark_stage_done(ids(tasks), "reward")
    return ids(tasks)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


# -- state machine ----------------------------------------------------------------------------


def test_task_walks_admitted_generated_scored_trained(j: Journal) -> None:
    tasks = specs(0, 1, group=2)
    assert j.admit(tasks, cursor=1) == 2
    rec = j.get("p0-s1")
    assert rec is not None
    assert (rec.state, rec.dataset_index, rec.sample_index, rec.group_id, rec.admitted_step) == (
        TaskState.ADMITTED,
        0,
        1,
        0,
        0,
    )
    assert j.mark_generated(ids(tasks), version=3, batch_id="rollout-7") == ids(tasks)
    assert j.mark_stage_done(ids(tasks), "reward") == ids(tasks)
    j.mark_trained(ids(tasks), step=1, version=3, max_staleness=0)

    rec = j.get("p0-s1")
    assert rec is not None
    assert rec.state is TaskState.TRAINED and rec.is_terminal
    assert (rec.batch_id, rec.generated_version, rec.trained_step, rec.trained_version) == (
        "rollout-7",
        3,
        1,
        3,
    )
    assert rec.stages_done == {"reward"}
    assert set(rec.timestamps) == {"admitted", "generated", "scored", "trained"}
    assert j.counts() == {"admitted": 0, "generated": 0, "scored": 0, "trained": 2, "dead": 0, "dropped": 0}
    assert j.step == 1
    assert j.get("never-admitted") is None


def test_reentering_the_same_state_is_an_idempotent_no_op(j: Journal) -> None:
    tasks = specs(0, 1)
    j.admit(tasks, cursor=1)
    assert j.admit(tasks, cursor=1) == 0  # redelivered admit
    assert j.mark_generated(ids(tasks), version=1, batch_id="a") == ids(tasks)
    assert j.mark_generated(ids(tasks), version=2, batch_id="b") == []
    rec = j.get(tasks[0].task_id)
    assert rec is not None and (rec.generated_version, rec.batch_id) == (1, "a")  # the first one wins
    assert j.mark_stage_done(ids(tasks), "reward") == ids(tasks)
    assert j.mark_stage_done(ids(tasks), "reward") == []
    assert j.mark_dead(ids(tasks), "reward timed out") == ids(tasks)
    assert j.mark_dead(ids(tasks), "another reason") == []
    rec = j.get(tasks[0].task_id)
    assert rec is not None and rec.reason == "reward timed out"
    assert j.counts()["dead"] == 2


@pytest.mark.parametrize(
    ("reach", "action", "src", "dst"),
    [
        ("admitted", "trained", "admitted", "trained"),
        ("generated", "trained", "generated", "trained"),
        ("scored", "generated", "scored", "generated"),
        ("trained", "generated", "trained", "generated"),
        ("trained", "dead", "trained", "dead"),
        ("dead", "generated", "dead", "generated"),
        ("dead", "trained", "dead", "trained"),
        ("generated", "admitted", "generated", "admitted"),
    ],
)
def test_illegal_transition_raises_naming_task_and_both_states(
    j: Journal, reach: str, action: str, src: str, dst: str
) -> None:
    tasks = specs(0, 1, group=1)
    tid = tasks[0].task_id
    j.admit(tasks, cursor=1)
    if reach in ("generated", "scored", "trained"):
        j.mark_generated([tid], version=0, batch_id="b")
    if reach in ("scored", "trained"):
        j.mark_stage_done([tid], "reward")
    if reach == "trained":
        j.mark_trained([tid], step=1, version=0, max_staleness=0)
    if reach == "dead":
        j.mark_dead([tid], "poison")
    before = j.get(tid)

    act = {
        "admitted": lambda: j.admit(tasks, cursor=1),
        "generated": lambda: j.mark_generated([tid], version=0, batch_id="b"),
        "trained": lambda: j.mark_trained([tid], step=2, version=0, max_staleness=0),
        "dead": lambda: j.mark_dead([tid], "late"),
    }[action]
    with pytest.raises(JournalError, match=rf"task '{tid}': illegal transition {src} -> {dst}"):
        act()
    assert j.get(tid) == before


def test_a_stage_result_before_generation_raises_and_after_death_is_ignored(j: Journal) -> None:
    early, dead = specs(0, 1, group=1), specs(1, 1, group=1)
    j.admit(early + dead, cursor=2)
    with pytest.raises(JournalError, match=rf"task '{early[0].task_id}': stage 'reward' finished before"):
        j.mark_stage_done(ids(early), "reward")
    j.mark_generated(ids(dead), version=0, batch_id="b")
    j.mark_dead(ids(dead), "poison")
    assert j.mark_stage_done(ids(dead), "reward") == []  # a late redelivery
    assert [r.state for r in (j.get(early[0].task_id), j.get(dead[0].task_id))] == [  # type: ignore[union-attr]
        TaskState.ADMITTED, TaskState.DEAD]


def test_a_refused_call_changes_nothing_for_any_task(j: Journal) -> None:
    good, bad = specs(0, 1, group=1), specs(1, 1, group=1)
    j.admit(good + bad, cursor=2)
    j.mark_dead(ids(bad), "poison")
    with pytest.raises(JournalError, match="dead -> generated"):
        j.mark_generated(ids(good) + ids(bad), version=0, batch_id="b")
    rec = j.get(good[0].task_id)
    assert rec is not None and rec.state is TaskState.ADMITTED  # one transaction: all or nothing
    with pytest.raises(JournalError, match="unknown task 'nope'"):
        j.mark_generated([*ids(good), "nope"], version=0, batch_id="b")
    assert j.counts()["admitted"] == 1


def test_scored_only_once_every_required_stage_is_done(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j", stages=("reference", "reward", "critic")) as jr:
        tasks = specs(0, 1)
        jr.admit(tasks, cursor=1)
        with pytest.raises(JournalError, match="before the task was generated"):
            jr.mark_stage_done(ids(tasks), "reward")
        jr.mark_generated(ids(tasks), version=0, batch_id="b")
        assert jr.mark_stage_done(ids(tasks), "reward") == []
        assert jr.mark_stage_done(ids(tasks), "reward") == []  # redelivery
        assert jr.mark_stage_done(ids(tasks[:1]), "critic") == []
        assert jr.mark_stage_done(ids(tasks), "reference") == ids(tasks[:1])
        assert jr.mark_stage_done(ids(tasks), "critic") == ids(tasks[1:])
        assert jr.mark_stage_done(ids(tasks), "critic") == []  # late result for a scored task
        assert jr.counts()["scored"] == 2
        with pytest.raises(JournalError, match="unknown scoring stage 'judge'"):
            jr.mark_stage_done(ids(tasks), "judge")


# -- invariants 2 and 3: exactly once, bounded staleness ---------------------------------------


def test_mark_trained_twice_raises_exactly_once(j: Journal) -> None:
    t = scored(j, specs(0, 2))
    j.mark_trained(t[:2], step=1, version=0, max_staleness=1)
    with pytest.raises(ExactlyOnceError, match=rf"task '{t[0]}' already counts in training step 1"):
        j.mark_trained(t, step=2, version=0, max_staleness=1)
    with pytest.raises(ExactlyOnceError, match="already counts in training step 1"):
        j.mark_trained(t[:1], step=1, version=0, max_staleness=1)  # even replaying the same step
    with pytest.raises(ExactlyOnceError, match="more than once in training step 2"):
        j.mark_trained([t[2], t[2]], step=2, version=0, max_staleness=1)
    assert j.counts()["trained"] == 2 and j.counts()["scored"] == 2 and j.step == 1


@pytest.mark.parametrize(
    ("generated", "trained", "max_staleness", "ok"),
    [
        (3, 3, 0, True),  # on-policy
        (3, 4, 0, False),  # one version stale, synchronous run
        (3, 5, 2, True),  # exactly at the bound
        (3, 6, 2, False),  # one past the bound
        (5, 4, 3, False),  # generated by a newer policy than the one trained: bookkeeping bug
    ],
)
def test_staleness_bound_is_enforced_by_mark_trained(
    j: Journal, generated: int, trained: int, max_staleness: int, ok: bool
) -> None:
    t = scored(j, specs(0, 1, group=1), version=generated)
    if ok:
        j.mark_trained(t, step=1, version=trained, max_staleness=max_staleness)
        rec = j.get(t[0])
        assert rec is not None and rec.state is TaskState.TRAINED
        return
    with pytest.raises(StalenessError, match=rf"task '{t[0]}': generated at version {generated}"):
        j.mark_trained(t, step=1, version=trained, max_staleness=max_staleness, batch=b"batch")
    rec = j.get(t[0])
    assert rec is not None and rec.state is TaskState.SCORED  # refused: nothing written
    assert j.step == 0 and j.get_batch(1) is None


def test_check_staleness_message_names_the_lag_and_bound() -> None:
    check_staleness("t", generated_version=2, trained_version=4, max_staleness=2)
    with pytest.raises(StalenessError, match="staleness 3 exceeds max_staleness 2"):
        check_staleness("t", generated_version=1, trained_version=4, max_staleness=2)


def test_step_commit_writes_tasks_step_and_batch_together(j: Journal) -> None:
    fresh = scored(j, specs(0, 1), version=1, cursor=1)
    stale = scored(j, specs(1, 1), version=0, cursor=2)
    with pytest.raises(StalenessError):
        j.mark_trained(fresh + stale, step=1, version=1, max_staleness=0, batch=b"step-1")
    assert (j.step, j.get_batch(1), j.counts()["trained"]) == (0, None, 0)
    j.mark_trained(fresh, step=1, version=1, max_staleness=0, batch=b"step-1")
    assert (j.step, j.get_batch(1), j.counts()["trained"]) == (1, b"step-1", 2)
    with pytest.raises(JournalError, match=r"training steps count from 1, got 0"):
        j.mark_trained(stale, step=0, version=1, max_staleness=1)


def test_cursor_step_and_versions_never_go_backwards(j: Journal) -> None:
    j.admit(specs(0, 2), cursor=2)
    with pytest.raises(JournalError, match="dataset cursor would go backwards: 2 -> 1"):
        j.admit(specs(5, 1), cursor=1)
    assert j.get("p5-s0") is None  # refused with the cursor: the tasks were not written either
    j.mark_trained(scored(j, specs(2, 1), cursor=3), step=4, version=0, max_staleness=0)
    with pytest.raises(JournalError, match="training step 3 is behind the journal's step 4"):
        j.mark_trained(scored(j, specs(3, 1), cursor=4), step=3, version=0, max_staleness=0)
    j.set_version("actor", 5)
    j.set_version("actor", 5)
    j.set_version("critic", 2)
    with pytest.raises(JournalError, match="actor version would go backwards: 5 -> 4"):
        j.set_version("actor", 4)
    assert (j.cursor, j.step, j.versions) == (4, 4, {"actor": 5, "critic": 2})


def test_run_id_binds_a_journal_to_one_run(j: Journal) -> None:
    assert j.run_id is None
    j.bind_run_id("abc")
    j.bind_run_id("abc")
    with pytest.raises(JournalError, match="belongs to run 'abc', not 'xyz'"):
        j.bind_run_id("xyz")
    assert j.run_id == "abc"


# -- run binding: journal and checkpoints belong together --------------------------------------


def run_cfg(tmp_path: Path, **journal: int) -> RunConfig:
    return parse_config({"run": {"dir": str(tmp_path / "run")}, "journal": journal})


def open_bound(cfg: RunConfig) -> Journal:
    return open_run_journal(cfg, stages=("reward",), trainable=("actor",))


def test_a_fresh_run_binds_its_journal_and_checkpoints_to_one_identity(tmp_path: Path) -> None:
    cfg = run_cfg(tmp_path)
    with open_bound(cfg) as jr:
        run_id = jr.run_id
    assert run_id and (cfg.checkpoint_dir / RUN_ID_FILE).read_text().strip() == run_id
    with open_bound(cfg) as jr:  # a restart keeps it
        assert jr.run_id == run_id


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_missing_or_empty_journal_of_an_existing_run_is_refused_naming_the_file(
    damage: str, tmp_path: Path
) -> None:
    cfg = run_cfg(tmp_path)
    with open_bound(cfg) as jr:
        jr.admit(specs(0, 2), cursor=2)
    data = cfg.journal_dir / "data.mdb"
    if damage == "deleted":
        shutil.rmtree(cfg.journal_dir)
    else:
        data.write_bytes(b"")
    with pytest.raises(RunBindingError, match=rf"journal {data} is (missing|empty).*belong to run") as info:
        open_bound(cfg)
    assert "\n" not in str(info.value)
    assert damage == "truncated" or not cfg.journal_dir.exists()  # nothing was recreated at step 0


def test_a_journal_of_another_run_is_refused(tmp_path: Path) -> None:
    cfg, other = run_cfg(tmp_path / "a"), run_cfg(tmp_path / "b")
    for c in (cfg, other):
        open_bound(c).close()
    shutil.rmtree(cfg.journal_dir)
    shutil.copytree(other.journal_dir, cfg.journal_dir)
    with pytest.raises(RunBindingError, match=r"belongs to run .* but the checkpoints in .* belong to run"):
        open_bound(cfg)


def test_checkpoints_gone_while_the_journal_records_them_is_refused(tmp_path: Path) -> None:
    cfg = run_cfg(tmp_path)
    with open_bound(cfg) as jr:
        jr.prune_batches("actor", 4)  # the actor acknowledged a checkpoint at step 4
    shutil.rmtree(cfg.checkpoint_dir)
    with pytest.raises(RunBindingError, match=r"records checkpoints \(actor at step 4\), but .*RUN_ID is missing"):
        open_bound(cfg)


def test_a_run_from_before_run_identities_is_adopted(tmp_path: Path) -> None:
    cfg = run_cfg(tmp_path)
    with Journal.open(cfg.journal_dir) as jr:  # written by code that knew no run identity
        jr.admit(specs(0, 1), cursor=1)
    with open_bound(cfg) as jr:
        assert jr.cursor == 1 and jr.run_id == (cfg.checkpoint_dir / RUN_ID_FILE).read_text().strip()


def test_a_filesystem_smaller_than_min_free_bytes_is_named_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = run_cfg(tmp_path, min_free_bytes=1 << 60)
    with caplog.at_level(logging.ERROR), open_bound(cfg):
        pass
    [line] = [r.getMessage() for r in caplog.records if "min_free_bytes" in r.getMessage()]
    assert f"below journal.min_free_bytes={1 << 60}" in line and "bytes free" in line


# -- crash safety ------------------------------------------------------------------------------

ADMIT_LOOP = textwrap.dedent(
    """
    import sys
    from services.core.journal.journal import Journal, TaskSpec
    path, prompts, group = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    j = Journal.open(path)
    start = j.cursor
    for b in range(100_000):
        first = start + b * prompts
        tasks = [TaskSpec(f"p{d}-s{k}", d, k, d) for d in range(first, first + prompts) for k in range(group)]
        j.admit(tasks, cursor=first + prompts)
        print(first + prompts, flush=True)  # acknowledged: this cursor is committed
    """
)


def test_admit_and_cursor_survive_kill_9_mid_loop_with_no_half_batch(tmp_path: Path) -> None:
    path, prompts, group = tmp_path / "journal", 4, 3
    for _round in range(3):  # kill, reopen, resume, kill again
        proc = subprocess.Popen(
            [sys.executable, "-c", ADMIT_LOOP, str(path), str(prompts), str(group)],
            stdout=subprocess.PIPE,
            env=child_env(),
            text=True,
        )
        assert proc.stdout is not None
        acked = 0
        for _ in range(15):  # let it commit a few batches, then kill it in the middle of the next
            line = proc.stdout.readline()
            assert line, f"admit loop died early (rc={proc.poll()})"
            acked = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()

        with Journal.open(path) as jr:
            cursor = jr.cursor
            assert cursor >= acked, "an acknowledged admit was lost"
            assert cursor % prompts == 0
            per_prompt = Counter(r.dataset_index for r in jr.iter_tasks())
            assert per_prompt == {d: group for d in range(cursor)}, "half a batch was committed"
            assert jr.counts()["admitted"] == len(jr.non_terminal()) == cursor * group


def test_stale_reader_left_by_a_killed_process_is_cleared(j: Journal) -> None:
    reader = textwrap.dedent(
        """
        import sys, time, lmdb
        env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8)
        txn = env.begin()  # takes a reader slot
        print("reading", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", reader, str(j.path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "reading"
        assert j.reader_check() == 0  # a live reader is not stale
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
    assert j.reader_check() == 1
    assert j.reader_check() == 0


# -- growth and full disks ---------------------------------------------------------------------


def test_full_map_grows_and_retries_transparently(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j", map_size=64 * KiB, max_map_size=64 << 20, sync=False) as jr:
        blobs = {step: os.urandom(100 * KiB) for step in range(1, 41)}  # 4 MB through a 64 KiB map
        for step, data in blobs.items():
            jr.put_batch(step, data)
        jr.admit(specs(0, 500), cursor=500)
        assert jr.map_size >= 4 << 20
        assert jr.batches_after(0) == sorted(blobs.items())
        assert jr.counts()["admitted"] == 1000


def test_map_at_max_size_raises_journal_full_and_keeps_committed_state(tmp_path: Path) -> None:
    path = tmp_path / "j"
    with Journal.open(path, map_size=64 * KiB, max_map_size=512 * KiB, sync=False) as jr:
        jr.admit(specs(0, 2), cursor=2)
        written: dict[int, bytes] = {}
        with pytest.raises(JournalFull) as err:
            for step in range(1, 40):  # 40 x 64 KiB cannot fit in 512 KiB
                data = os.urandom(64 * KiB)
                jr.put_batch(step, data)
                written[step] = data
        msg = str(err.value)
        assert str(path) in msg and "reached max_map_size 524288" in msg and "bytes free" in msg
        assert written and jr.batches_after(0) == sorted(written.items())
        assert jr.cursor == 2
        jr.prune_batches("actor", max(written))  # freeing pages makes room again
        jr.admit(specs(2, 1), cursor=3)
        jr.put_batch(100, b"small")  # LMDB reuses the freed pages two commits later
        jr.put_batch(101, os.urandom(64 * KiB))
    with Journal.open(path, sync=False) as jr:
        assert (jr.cursor, jr.get_batch(100), jr.counts()["admitted"]) == (3, b"small", 6)


def test_full_filesystem_raises_journal_full_then_recovers_when_space_returns(small_fs: Path) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (768 * KiB))  # the space we hand back later
    path = small_fs / "journal"
    jr = Journal.open(path, map_size=64 * KiB)
    try:
        jr.admit(specs(0, 4), cursor=4)
        jr.mark_generated(ids(specs(0, 4)), version=0, batch_id="b")
        written: dict[int, bytes] = {}
        with pytest.raises(JournalFull) as err:
            for step in range(1, 100):  # 100 x 64 KiB is three times the filesystem
                data = os.urandom(64 * KiB)
                jr.put_batch(step, data)
                written[step] = data
        msg = str(err.value)
        assert str(path) in msg and "bytes free on its filesystem" in msg and "state is intact" in msg
        assert not jr.has_space(64 * KiB)

        # The committed state is intact and readable.
        assert written and jr.batches_after(0) == sorted(written.items())
        assert (jr.cursor, jr.counts()["generated"]) == (4, 8)

        filler.unlink()  # space returns: the same handle keeps working
        assert jr.has_space(64 * KiB)
        jr.put_batch(1000, b"after")
        jr.admit(specs(4, 1), cursor=5)
        jr.mark_stage_done(ids(specs(0, 4)), "reward")
    finally:
        jr.close()
    with Journal.open(path) as jr:
        assert jr.get_batch(1000) == b"after"
        assert jr.batches_after(0)[: len(written)] == sorted(written.items())
        assert jr.counts() == {"admitted": 2, "generated": 0, "scored": 8, "trained": 0, "dead": 0, "dropped": 0}


def test_disk_free_bytes_and_has_space(j: Journal) -> None:
    free = j.disk_free_bytes()
    assert free > 0
    assert j.has_space(0) and not j.has_space(free + (1 << 40))
    usage = j.usage()
    assert usage["map_size"] == j.map_size and usage["used_bytes"] > 0


# -- batches and results -----------------------------------------------------------------------


def test_batches_after_and_prune_keep_what_the_other_trainable_service_needs(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j", trainable=("actor", "critic"), sync=False) as jr:
        for step in range(1, 7):
            jr.put_batch(step, f"batch-{step}".encode())
        assert [s for s, _ in jr.batches_after(4)] == [5, 6]
        assert jr.batches_after(0)[0] == (1, b"batch-1")

        assert jr.prune_batches("actor", 4) == 0  # the critic has not checkpointed: it needs 1..6
        assert [s for s, _ in jr.batches_after(0)] == [1, 2, 3, 4, 5, 6]
        assert jr.prune_batches("critic", 2) == 2
        assert [s for s, _ in jr.batches_after(0)] == [3, 4, 5, 6]
        assert jr.prune_batches("critic", 5) == 2  # the actor still needs 5 and 6
        assert [s for s, _ in jr.batches_after(0)] == [5, 6]
        assert jr.prune_batches("critic", 3) == 0  # a late, older acknowledgement un-covers nothing
        assert jr.checkpoint_steps == {"actor": 4, "critic": 5}
        with pytest.raises(JournalError, match="'reward' is not a trainable service"):
            jr.prune_batches("reward", 6)


def test_results_are_put_if_absent_so_redelivery_never_counts_twice(j: Journal) -> None:
    assert j.put_result_if_absent("t1", "reward", b"first") is True
    assert j.put_result_if_absent("t1", "reward", b"second") is False
    assert j.put_result_if_absent("t1", "critic", b"values") is True
    assert j.put_result_if_absent("t10", "reward", b"other") is True
    assert j.get_result("t1", "reward") == b"first"
    assert (j.get_result("t1", "critic"), j.get_result("t10", "reward")) == (b"values", b"other")


# -- queries -----------------------------------------------------------------------------------


def test_non_terminal_lists_exactly_the_non_terminal_tasks(tmp_path: Path) -> None:
    path = tmp_path / "j"
    with Journal.open(path, sync=False) as jr:
        tasks = specs(0, 5, group=1)
        t = ids(tasks)
        jr.admit(tasks, cursor=5)
        jr.mark_generated(t[1:], version=0, batch_id="b")
        jr.mark_stage_done(t[2:], "reward")
        jr.mark_trained(t[3:4], step=1, version=0, max_staleness=0)
        jr.mark_dead(t[4:], "reward crashed")
        assert [r.task_id for r in jr.non_terminal()] == t[:3]
        assert [r.state for r in jr.non_terminal()] == [
            TaskState.ADMITTED,
            TaskState.GENERATED,
            TaskState.SCORED,
        ]
        assert jr.in_flight() == 3
    with Journal.open(path, sync=False) as jr:  # what reconciliation sees after a restart
        assert [r.task_id for r in jr.non_terminal()] == t[:3]
        assert jr.counts() == {"admitted": 1, "generated": 1, "scored": 1, "trained": 1, "dead": 1, "dropped": 0}


def test_iter_tasks_pages_through_every_task(j: Journal, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "_ITER_CHUNK", 7)
    j.admit(specs(0, 25, group=2), cursor=25)
    got = [r.task_id for r in j.iter_tasks()]
    assert sorted(got) == sorted(ids(specs(0, 25, group=2))) and len(got) == 50


def test_a_journal_opens_once_per_process(j: Journal) -> None:
    with pytest.raises(JournalError, match="already open in this process"):
        Journal.open(j.path)
    j.close()
    with pytest.raises(JournalError, match="is closed"):
        _ = j.cursor
    with Journal.open(j.path) as again:
        assert again.cursor == 0


def test_concurrent_threads_are_serialised_even_while_the_map_grows(tmp_path: Path) -> None:
    # The controller calls the journal through asyncio.to_thread: writes come from many threads.
    with Journal.open(tmp_path / "j", map_size=64 * KiB, sync=False) as jr:
        errors: list[BaseException] = []

        def worker(w: int) -> None:
            try:
                for i in range(20):
                    jr.put_batch(w * 1000 + i + 1, os.urandom(8 * KiB))
                    jr.put_result_if_absent(f"w{w}-{i}", "reward", b"x")
                    _ = jr.counts()
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert not errors
        assert len(jr.batches_after(0)) == 160


# -- model-based: counters and the live index agree with the records ---------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["generate", "score", "train", "dead"]), st.integers(0, 7)), max_size=40
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_counts_and_non_terminal_always_agree_with_records(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]]
) -> None:
    with Journal.open(tmp_path_factory.mktemp("j") / "j", sync=False) as jr:
        tasks = specs(0, 8, group=1)
        jr.admit(tasks, cursor=8)
        step = 0
        for op, i in ops:
            tid = tasks[i].task_id
            try:
                if op == "generate":
                    jr.mark_generated([tid], version=step, batch_id="b")
                elif op == "score":
                    jr.mark_stage_done([tid], "reward")
                elif op == "train":
                    jr.mark_trained([tid], step=step + 1, version=step, max_staleness=10)
                    step += 1
                else:
                    jr.mark_dead([tid], "chaos")
            except JournalError:
                pass  # refused transitions must leave everything consistent
        records = list(jr.iter_tasks())
        tally = Counter(r.state.value for r in records)
        assert jr.counts() == {s.value: tally.get(s.value, 0) for s in TaskState}
        assert {r.task_id for r in jr.non_terminal()} == {r.task_id for r in records if not r.is_terminal}
        assert tally["trained"] == step  # each train op that succeeded counted exactly one task
