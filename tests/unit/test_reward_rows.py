"""A user's bad row costs that row: the reward's failing rows are isolated by bisection (bounded
calls), named in the ScoreBatch (validated on the wire), left out of the step's groups by the
assembler, and counted by the evaluation, while the other rows keep their rewards."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.controller.assembler import StepAssembler
from services.controller.components import ComponentMeans
from services.controller.unscored import GROUP_REASON, end_unscored
from services.core.config.run import TaskSection
from services.core.ids import task_id
from services.core.journal.journal import Journal, TaskSpec
from services.core.pb import rlfleet_pb2 as pb
from services.models.engine import Completion, completions_to_rollout
from services.models.roles.tokenizer import build_tokenizer
from services.reward.scorer import BadReward, RewardScorer
from services.rl.batch import Rollout
from services.rl.wire import WireError, parse_message, score_from_proto, score_to_proto
from services.tasks import evaluation as ev
from services.tasks import load_task
from services.tasks.base import Prompt
from services.tasks.chat import encode_prompts
from services.tasks.reward_rows import score_rows
from services.tasks.rewards import RewardResult, RewardSet, make_component

MB = 1 << 20
BAD_ROWS = "tests.faults.chaos_rewards:bad_rows"  # raises on index % 10 == 3, NaN on index 8


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(i, f"q{i}", str(i)) for i in range(n)]


def _batched_set(bad: set[int], calls: list[int]) -> RewardSet:
    def fn(completions: list[str], prompts: list[str]) -> list[float]:
        calls.append(len(completions))
        if any(int(p[1:]) in bad for p in prompts):
            raise ValueError("a row it cannot score")
        return [float(len(c)) for c in completions]

    return RewardSet([make_component(fn, "fn", 1.0, ("answer",))])


@pytest.mark.parametrize("bad", [set(), {5}, {0, 31}, {3, 4, 17}, set(range(32))])
def test_bisection_isolates_exactly_the_failing_rows_in_at_most_2n_minus_1_calls(bad: set[int]) -> None:
    calls: list[int] = []
    rs = _batched_set(bad, calls)
    prompts = _prompts(32)
    out = score_rows(rs.score, prompts, ["x" * i for i in range(32)])
    assert set(out.failed) == bad
    assert all(f.reason == "reward_error" and "raised ValueError" in f.message for f in out.failed.values())
    assert [out.total[i] for i in range(32) if i not in bad] == [float(i) for i in range(32) if i not in bad]
    assert out.calls == len(calls) <= 2 * 32 - 1
    if len(bad) == 1:
        assert out.calls <= 1 + 2 * 5, "one bad row costs about 2 log2(n) calls more"


def test_a_per_row_reward_with_components_keeps_the_good_rows_values_and_means() -> None:
    task = load_task(TaskSection(name="arithmetic", rewards=[{"fn": BAD_ROWS}, {"fn": "task", "weight": 0.5}]))
    prompts = [task.prompt(i) for i in range(10)]
    out = score_rows(task.score, prompts, [p.answer for p in prompts])
    assert {i: f.reason for i, f in out.failed.items()} == {3: "reward_error", 8: "non_finite_reward"}
    assert "prompt 3" in out.failed[3].message and "bad_rows" in out.failed[3].message
    assert [out.total[i] for i in range(10) if i not in (3, 8)] == [1.5] * 8
    assert out.means() == {"bad_rows": 1.0, "task": 1.0}


def _rollout(task: object, tok: object, indices: list[int], completions: list[str]) -> Rollout:
    prompts = encode_prompts(task, tok, indices)  # type: ignore[arg-type]
    comps = [Completion(list(tok(c, add_special_tokens=False)["input_ids"]), [0.0] * len(c), "stop")  # type: ignore[operator]
             for c in completions]
    return completions_to_rollout([f"t{i}-0" for i in indices], prompts, comps, indices, 0, tok.pad_token_id)  # type: ignore[attr-defined]


def test_the_reward_service_names_the_unscored_rows_and_dead_letters_a_batch_with_none_scored() -> None:
    task = load_task(TaskSection(name="arithmetic", reward_fn=BAD_ROWS))
    tok = build_tokenizer(task)
    scorer = RewardScorer(task, tok)
    idx = [2, 3, 4, 8]
    out = scorer.score_rows(_rollout(task, tok, idx, [task.prompt(i).answer for i in idx]))
    assert set(out.unscored) == {"t3-0", "t8-0"}
    assert out.unscored["t3-0"].startswith("reward_error: reward 'bad_rows' raised ValueError")
    assert out.unscored["t8-0"].startswith("non_finite_reward: ")
    assert out.values.tolist() == [1.0, 0.0, 1.0, 0.0]  # placeholders 0 for the unscored rows
    with pytest.raises(BadReward) as err:
        scorer.score_rows(_rollout(task, tok, [3, 13], ["1", "2"]))
    assert err.value.reason == "reward_error" and "no row of the batch could be scored" in str(err.value)


def test_unscored_rows_round_trip_and_bad_ones_are_rejected_naming_the_field() -> None:
    ids = ["t0-0", "t0-1", "t1-0", "t1-1"]
    msg = score_to_proto("b0:x", "reward", ids, torch.zeros(4), unscored={"t1-0": "reward_error: boom"})
    s = score_from_proto(parse_message(pb.ScoreBatch, msg.SerializeToString(), max_bytes=MB), max_bytes=MB,
                         expected_stage="reward", expected_rows=4)
    assert s.unscored == {"t1-0": "reward_error: boom"}
    cases = [({"t9-0": "reward_error: x"}, "unknown_tasks"), ({"t0-0": " "}, "bad_reason"),
             ({t: "reward_error: x" for t in ids}, "shape_mismatch")]
    for unscored, reason in cases:
        bad = score_to_proto("b0:x", "reward", ids, torch.zeros(4), unscored=unscored)
        with pytest.raises(WireError) as exc:
            score_from_proto(bad, max_bytes=MB, expected_stage="reward", expected_rows=4)
        assert exc.value.reason == reason and "unscored" in str(exc.value)
    other = score_to_proto("b0:x", "critic", ids, torch.zeros(4, 3))
    other.unscored["t0-0"] = "reward_error: x"
    with pytest.raises(WireError, match="must not set unscored"):
        score_from_proto(other, max_bytes=MB, expected_stage="critic", expected_rows=4)


def _group_rollout(first: int, groups: int, size: int) -> Rollout:
    n = groups * size
    return Rollout(
        task_ids=[f"t{first + g}-{k}" for g in range(groups) for k in range(size)],
        prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.ones(n, 3, dtype=torch.long), response_mask=torch.ones(n, 3, dtype=torch.bool),
        behaviour_logprobs=torch.zeros(n, 3),
        group_ids=torch.tensor([first + g for g in range(groups) for _ in range(size)]))


def test_a_batch_that_lost_a_group_is_split_over_steps_of_exactly_samples_per_step() -> None:
    a = StepAssembler(["reward"], samples_per_step=8)  # 2 batches of 2 groups of 2 rows per step
    for first in (0, 2, 4):
        a.add_rollout(f"b{first}:r", _group_rollout(first, 2, 2), order=first)
        a.add_score(f"b{first}:r", "reward", torch.arange(4, dtype=torch.float32) + first,
                    {"t0-1": "reward_error: x"} if first == 0 else None)
        a.mark_ready(f"b{first}")
    assert a.unscored_of("b0") == {"t0-1": "reward_error: x"} and a.unscored_of("b2") == {}
    a.exclude("b0", [0])  # its group left the run
    step = a.take_step()
    assert step is not None
    assert [(rid, r.task_ids) for rid, r in step] == [
        ("b0:r", ["t1-0", "t1-1"]), ("b2:r", ["t2-0", "t2-1", "t3-0", "t3-1"]), ("b4:r", ["t4-0", "t4-1"])]
    assert step[0][1].rewards.tolist() == [2.0, 3.0]  # type: ignore[union-attr]
    assert a.batches() == ["b4"] and a.kept_groups("b4") == [5]
    assert a.take_step() is None  # 2 rows left, a step needs 8


def test_the_evaluation_reports_the_rows_it_scored_and_counts_the_others() -> None:
    task = load_task(TaskSection(name="arithmetic", reward_fn=BAD_ROWS))
    prompts = ev.eval_prompts(task, 20)
    res = {"greedy": ev.evaluate_mode(task, "greedy", prompts, [p.answer for p in prompts], reward_model=False),
           "sampled": ev.unscored_result(task, "sampled", ["x"] * 20)}  # its reward timed out
    assert res["greedy"].rewards is not None and [i for i, r in enumerate(res["greedy"].rewards) if r is None] == [
        3, 8, 13]
    assert ev.metrics_of(res) == {"eval_reward_greedy": 1.0, "eval_unscored_greedy": 3.0, "eval_unscored": 20.0}
    lines = ev.sample_lines(1, 1, prompts, res)
    assert sum('"reward": null' in x for x in lines) == 23


def _never(prompts: Sequence[Prompt], completions: Sequence[str]) -> RewardResult:
    raise AssertionError("not called for an empty batch")


def test_an_empty_batch_calls_no_reward() -> None:
    assert score_rows(_never, [], []).total == []


class _Ctl:
    """What end_unscored uses of the controller: a real journal and assembler, events and component means."""

    def __init__(self, tmp: Path) -> None:
        self.journal = Journal.open(tmp / "j", sync=False, metasync=False)
        self.assembler = StepAssembler(["reward"], samples_per_step=8)
        self.reward_parts = ComponentMeans()
        self.progress: dict[str, float] = {"b0": 0.0}
        self.dead: list[tuple[str, str]] = []
        self.events = self

    def emit(self, kind: str, **fields: Any) -> None:
        self.dead.append((fields["task_id"], fields["reason"]))

    async def durable(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def test_an_unscored_row_ends_dead_with_its_reason_and_takes_the_rest_of_its_group_along(tmp_path: Path) -> None:
    ctl = _Ctl(tmp_path)
    specs = [TaskSpec(task_id(i, k), i, k, i) for i in range(2) for k in range(2)]
    ctl.journal.admit(specs, cursor=2)
    ctl.journal.mark_generated([s.task_id for s in specs], 0, "b0:x")
    ctl.assembler.add_rollout("b0:x", _group_rollout(0, 2, 2), order=0)
    ctl.assembler.add_score("b0:x", "reward", torch.zeros(4), {"t1-0": "reward_error: reward 'f' raised"})
    recs = [ctl.journal.get(s.task_id) for s in specs]
    assert asyncio.run(end_unscored(ctl, "b0", recs)) == {"t1-0", "t1-1"}  # type: ignore[arg-type]
    assert dict(ctl.dead) == {"t1-0": "reward_error: reward 'f' raised",
                              "t1-1": f"{GROUP_REASON}: task t1-0 of its group could not be scored (reward_error);"
                                      " a group trains whole"}
    assert ctl.assembler.kept_groups("b0") == [0] and ctl.journal.get("t0-0").state == "generated"  # type: ignore[union-attr]
    recs = [ctl.journal.get(s.task_id) for s in specs]
    assert asyncio.run(end_unscored(ctl, "b0", recs)) == set(), "a replay ends nothing twice"  # type: ignore[arg-type]
    ctl.assembler.add_score("b0:x", "reward", torch.zeros(4), {"t0-1": "bad_reward: x"})  # a later, second score
    assert ctl.assembler.unscored_of("b0") == {"t1-0": "reward_error: reward 'f' raised"}, "the first score's set wins"
    ctl.journal.close()


def test_a_batch_whose_every_group_lost_a_row_is_forgotten(tmp_path: Path) -> None:
    ctl = _Ctl(tmp_path)
    specs = [TaskSpec(task_id(i, k), i, k, i) for i in range(2) for k in range(2)]
    ctl.journal.admit(specs, cursor=2)
    ctl.journal.mark_generated([s.task_id for s in specs], 0, "b0:x")
    ctl.assembler.add_rollout("b0:x", _group_rollout(0, 2, 2), order=0)
    ctl.assembler.add_score("b0:x", "reward", torch.zeros(4), {"t0-0": "reward_error: a", "t1-1": "reward_error: b"})
    recs = [ctl.journal.get(s.task_id) for s in specs]
    assert asyncio.run(end_unscored(ctl, "b0", recs)) is None  # type: ignore[arg-type]
    assert ctl.assembler.pending() == 0 and "b0" not in ctl.progress
    assert ctl.journal.counts()["dead"] == 4
    ctl.journal.close()
