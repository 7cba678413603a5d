"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2, eq. 11): the shared rule, the local loop's
step filling, the journal's `dropped` state, the assembler's in-order group steps, the config, and
the audit's checks of dropped groups and full batches, all on the real journal and event log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.controller.assembler import StepAssembler
from services.controller.sampling import check_bound
from services.core.config.run import ConfigError, parse_config
from services.core.ids import task_id
from services.core.journal.journal import Journal, JournalError, TaskSpec, TaskState
from services.rl.batch import Rollout
from services.rl.dynamic_sampling import DynamicSamplingExhausted, fill_step, filtered_reason, judge_groups
from services.rl.wire import score_to_proto
from tests.unit.test_audit import GROUP, Run


def rollout(first: int, prompts: int, group: int, rewards: list[float]) -> Rollout:
    rows = prompts * group
    r = Rollout(
        task_ids=[task_id(first + i // group, i % group) for i in range(rows)],
        prompt_ids=torch.full((rows, 2), 3), prompt_mask=torch.ones(rows, 2, dtype=torch.bool),
        response_ids=torch.full((rows, 3), 4), response_mask=torch.ones(rows, 3, dtype=torch.bool),
        behaviour_logprobs=torch.full((rows, 3), -1.0),
        group_ids=torch.tensor([first + i // group for i in range(rows)]), version=0)
    r.rewards = torch.tensor(rewards)
    return r


def test_a_group_is_judged_equal_only_when_every_reward_is_within_the_tolerance() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-9, 0.2, 0.2], dtype=torch.float64)
    verdicts = judge_groups(rewards, torch.tensor([7, 7, 8, 8, 9, 9, 3, 3]), tol=1e-6)
    assert [(v.group_id, v.rows, v.equal) for v in verdicts] == [
        (7, [0, 1], True), (8, [2, 3], False), (9, [4, 5], True), (3, [6, 7], True)]
    assert not judge_groups(rewards[4:6], torch.tensor([1, 1]), tol=0.0)[0].equal
    assert filtered_reason(verdicts[0].value) == "filtered: all rewards equal (1)"


def test_local_step_keeps_the_first_unequal_groups_in_order_and_counts_what_it_dropped() -> None:
    # Messages of 2 prompts x 2 samples: per message, which groups are all-equal.
    table = {0: [1, 1, 0, 1], 2: [0, 0, 0, 0], 4: [1, 0, 1, 1], 6: [0, 1, 1, 0]}
    asked: list[int] = []

    def sample(first: int) -> tuple[Rollout, dict[str, torch.Tensor]]:
        asked.append(first)
        r = rollout(first, 2, 2, [float(x) for x in table[first]])
        return r, {"correct": r.rewards.clone() * 10}  # type: ignore[union-attr]

    out = fill_step(1, 0, prompts_per_step=3, prompts_per_message=2, tol=1e-6, max_rounds=10, sample=sample)
    assert asked == [0, 2, 4, 6] and out.cursor == 8 and out.prompts == 8
    assert [g.task_ids for g in out.groups] == [["t1-0", "t1-1"], ["t4-0", "t4-1"], ["t6-0", "t6-1"]]
    # t0, t2, t3 and t5 are all-equal; t7, kept beyond the step's 3 groups, is surplus.
    assert (out.filtered, out.surplus) == (4, 1)
    assert out.components == {"correct": [0.0, 10.0, 10.0, 0.0, 0.0, 10.0]}
    assert out.stats() == {"dropped_groups": 4.0, "surplus_groups": 1.0, "admitted_prompts": 8.0}


def test_local_step_that_only_finds_equal_groups_stops_with_an_error_naming_the_bound() -> None:
    def sample(first: int) -> tuple[Rollout, dict[str, torch.Tensor]]:
        return rollout(first, 2, 2, [1.0, 1.0, 0.0, 0.0]), {}

    with pytest.raises(DynamicSamplingExhausted, match=r"step 3 dropped 4 groups .*dynamic_sampling_max_rounds 2"):
        fill_step(3, 0, prompts_per_step=2, prompts_per_message=2, tol=1e-6, max_rounds=2, sample=sample)


def _scored_journal(path: Path, n: int = 4) -> tuple[Journal, list[TaskSpec]]:
    j = Journal.open(path, sync=False, metasync=False)
    specs = [TaskSpec(task_id(i, k), i, k, i) for i in range(n) for k in range(2)]
    j.admit(specs, cursor=n)
    j.mark_generated([s.task_id for s in specs], 0, "b0:x")
    j.mark_stage_done([s.task_id for s in specs], "reward")
    return j, specs


def test_dropped_is_terminal_counted_per_step_and_kind_and_survives_a_reopen(tmp_path: Path) -> None:
    j, specs = _scored_journal(tmp_path / "j")
    assert j.prompts_for(1) == 4
    assert j.mark_dropped(["t0-0", "t0-1"], "filtered: all rewards equal (1)", step=1, kind="filtered") == [
        "t0-0", "t0-1"]
    assert j.mark_dropped(["t0-0", "t1-0"], "surplus: x", step=1, kind="surplus") == ["t1-0"]
    assert j.dropped_for(1) == {"filtered": 2, "surplus": 1} and j.dropped_for(2) == {}
    with pytest.raises(JournalError, match="illegal transition dropped -> trained"):
        j.mark_trained(["t0-0"], 1, 0, 0)
    with pytest.raises(JournalError, match="illegal transition dropped -> dead"):
        j.mark_dead(["t0-1"], "late")
    j.close()
    j = Journal.open(tmp_path / "j")
    rec = j.get("t0-0")
    assert rec is not None and rec.state is TaskState.DROPPED and rec.dropped_step == 1
    assert rec.reason == "filtered: all rewards equal (1)"
    assert j.counts()["dropped"] == 3 and j.in_flight() == 5
    assert {r.task_id for r in j.non_terminal()} == {s.task_id for s in specs} - {"t0-0", "t0-1", "t1-0"}
    # The bound is the journal's: a restarted controller stops where the crashed one would have.
    check_bound(j, 1, group_size=2, prompts_per_step=2, max_rounds=1)  # 1 group filtered, 2 allowed
    j.mark_dropped(["t2-0", "t2-1"], "filtered: all rewards equal (0)", step=1, kind="filtered")
    with pytest.raises(DynamicSamplingExhausted, match="step 1 dropped 2 groups"):
        check_bound(j, 1, group_size=2, prompts_per_step=2, max_rounds=1)
    j.close()


def test_group_steps_take_kept_groups_in_dataset_order_and_wait_for_earlier_batches() -> None:
    a = StepAssembler(["reward"], samples_per_step=6, group_size=2)
    for first in (0, 2, 4):
        a.expect(f"b{first}", first)
    for first in (2, 4):  # b0 has no rollout yet: nothing may be taken before it
        r = rollout(first, 2, 2, [0.0, 1.0, 1.0, 0.0])
        assert a.add_score(f"b{first}:n", "reward", r.rewards)  # type: ignore[arg-type]  # before its rollout
        a.add_rollout(f"b{first}:n", r, order=first)
        assert a.has_all_scores(f"b{first}")
        a.mark_ready(f"b{first}")
    assert a.take_step() is None
    r0 = rollout(0, 2, 2, [1.0, 1.0, 0.0, 1.0])
    a.add_rollout("b0:n", r0, order=0)
    a.add_score("b0:n", "reward", r0.rewards)  # type: ignore[arg-type]
    a.exclude("b0", [0])  # dropped: all rewards equal
    a.mark_ready("b0")
    parts = a.take_step()
    assert parts is not None
    assert [(rid, r.task_ids) for rid, r in parts] == [
        ("b0:n", ["t1-0", "t1-1"]), ("b2:n", ["t2-0", "t2-1", "t3-0", "t3-1"])]
    assert parts[0][1].rewards.tolist() == [0.0, 1.0]  # type: ignore[union-attr]
    assert a.batches() == ["b4"] and a.kept_groups("b4") == [4, 5]
    assert a.take_step() is None  # 2 groups left, a step needs 3


def test_dapo_turns_dynamic_sampling_on_and_the_window_grows_by_one_message_less_a_group() -> None:
    base = {"batch": {"prompts_per_step": 8, "prompts_per_message": 4}}
    dapo = parse_config({"algo": {"name": "dapo", "group_size": 4}, **base})
    assert dapo.algo.dynamic_sampling and dapo.admission_window == 8 * 4 + 3 * 4
    # Every run has the slack (unscored rows take groups out too); less than a message, it admits
    # nothing more while whole messages are in flight.
    grpo = parse_config({"algo": {"name": "grpo", "group_size": 4}, **base})
    assert not grpo.algo.dynamic_sampling and grpo.admission_window == 8 * 4 + 3 * 4
    assert not parse_config({"algo": {"name": "dapo", "dynamic_sampling": False}}).algo.dynamic_sampling
    with pytest.raises(ConfigError, match="dynamic_sampling compares the responses of one prompt"):
        parse_config({"algo": {"name": "ppo", "dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        parse_config({"algo": {"name": "dapo", "dynamic_sampling_max_rounds": 0}})


class DropRun(Run):
    """test_audit's run, with ids of the run's grammar and reward records like the controller's."""

    def admit(self, prompts: int = 2) -> list[str]:
        specs = [TaskSpec(task_id(d, k), d, k, d) for d in range(self.prompt, self.prompt + prompts)
                 for k in range(GROUP)]
        self.prompt += prompts
        self.journal.admit(specs, cursor=self.prompt)
        self.ev.emit("admitted", task_ids=[s.task_id for s in specs], cursor=self.prompt)
        return [s.task_id for s in specs]

    def rewards(self, ids: list[str], values: list[float]) -> None:
        rid = f"b{ids[0]}"  # the rollout id Run.generate journals
        msg = score_to_proto(rid, "reward", ids, torch.tensor(values))
        self.journal.put_result_if_absent(rid, "reward", msg.SerializeToString())

    def drop(self, ids: list[str], reason: str, kind: str) -> None:
        self.journal.mark_dropped(ids, reason, step=self.step + 1, kind=kind)
        self.ev.emit("dropped", task_ids=ids, reason=reason, step=self.step + 1)


def test_audit_accepts_a_dropped_equal_group_and_names_an_unequal_or_partial_one(tmp_path: Path) -> None:
    run = DropRun(tmp_path)
    for values, dropped in (([1.0, 1.0, 0.0, 1.0], 2), ([0.0, 1.0, 1.0, 1.0], 2), ([0.0, 0.0, 1.0, 0.0], 1)):
        ids = run.admit()
        run.generate(ids)
        run.score(ids)
        run.rewards(ids, values)
        run.drop(ids[:dropped], "filtered: all rewards equal (1)", "filtered")
    kept = [t for t in run.journal.iter_tasks() if t.state is TaskState.SCORED]
    run.train([t.task_id for t in kept][:4])  # t1, t3: a full batch of whole groups
    report = run.audit(finished=False)
    v = report.check(1).violations
    # Group 2 ([0, 1]) was not all-equal; in group 4 only one of its two tasks was dropped.
    assert dict(v) == {"dropped_unequal": 1, "dropped_part_of_group": 1}, report.render()
    assert report.check(1).stats["dropped tasks by reason"] == {"filtered": 5}
    assert report.check(2).passed
    assert report.tasks_by_state["dropped"] == 5


def test_audit_accepts_a_clean_dynamic_sampling_run_and_refuses_a_partial_batch(tmp_path: Path) -> None:
    run = DropRun(tmp_path)
    ids = run.admit(3)
    run.generate(ids)
    run.score(ids)
    run.rewards(ids, [1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    run.drop(ids[:2], "filtered: all rewards equal (1)", "filtered")
    run.train(ids[2:])
    assert run.audit(finished=True).ok
    run2 = DropRun(tmp_path / "2")
    ids = run2.admit(2)
    run2.generate(ids)
    run2.score(ids)
    run2.train(ids[:3])  # three tasks: neither samples_per_step nor whole groups
    assert dict(run2.audit(finished=False).check(2).violations) == {"partial_batch": 1, "partial_group": 1}
