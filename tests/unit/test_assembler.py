from __future__ import annotations

import numpy as np

from services.controller.assembler import StepAssembler
from services.rl.batch import RolloutArrays


def _rollout(first: int, n: int = 2) -> RolloutArrays:
    return RolloutArrays(
        task_ids=[f"t{first}-{k}" for k in range(n)],
        prompt_ids=np.ones((n, 2), dtype=np.int64), prompt_mask=np.ones((n, 2), dtype=bool),
        response_ids=np.ones((n, 3), dtype=np.int64), response_mask=np.ones((n, 3), dtype=bool),
        behaviour_logprobs=np.zeros((n, 3), dtype=np.float32), group_ids=np.full((n,), first, dtype=np.int64),
    )


def _score(a: StepAssembler, rid: str, n: int = 2) -> None:
    a.add_score(rid, "reward", np.ones(n, dtype=np.float32))
    a.add_score(rid, "reference", np.zeros((n, 3), dtype=np.float32))


def test_first_rollout_of_a_prompt_batch_wins_and_scores_of_the_loser_are_ignored() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=2)
    assert a.add_rollout("b0:aaa", _rollout(0), order=0)
    assert not a.add_rollout("b0:bbb", _rollout(0), order=0)
    assert not a.add_score("b0:bbb", "reward", np.ones(2, dtype=np.float32))
    assert a.add_score("b0:aaa", "reward", np.ones(2, dtype=np.float32))
    assert not a.add_score("b0:aaa", "reward", np.ones(2, dtype=np.float32)), "a duplicate score never counts twice"


def test_a_batch_is_taken_only_when_all_scores_are_in_and_marked_ready() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=2)
    a.add_rollout("b0:x", _rollout(0), order=0)
    a.add_score("b0:x", "reward", np.ones(2, dtype=np.float32))
    assert a.take_step() is None
    a.add_score("b0:x", "reference", np.zeros((2, 3), dtype=np.float32))
    assert a.has_all_scores("b0") and a.take_step() is None, "not ready until the journal says scored"
    a.mark_ready("b0")
    step = a.take_step()
    assert step is not None and step[0][1].rewards is not None and step[0][1].ref_logprobs is not None
    assert a.pending() == 0


def test_scores_that_arrive_before_their_rollout_are_kept() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=2)
    _score(a, "b4:y")
    a.add_rollout("b4:y", _rollout(4), order=4)
    assert a.has_all_scores("b4")


def test_steps_take_the_oldest_batches_first_and_exactly_one_step() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=4)
    for first in (8, 0, 4):
        a.add_rollout(f"b{first}:r", _rollout(first), order=first)
        _score(a, f"b{first}:r")
        a.mark_ready(f"b{first}")
    step = a.take_step()
    assert step is not None and [rid for rid, _ in step] == ["b0:r", "b4:r"]
    assert a.take_step() is None, "one batch left is not a whole step"


def test_dropped_batches_are_forgotten() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=2)
    a.add_rollout("b0:x", _rollout(0), order=0)
    a.drop("b0")
    assert a.rollout_id_of("b0") is None and a.pending() == 0


def test_a_step_takes_whole_groups_of_a_batch_and_leaves_the_rest_for_the_next() -> None:
    a = StepAssembler(["reward"], samples_per_step=2)
    r = _rollout(0, n=4)
    r.group_ids = np.array([0, 0, 1, 1], dtype=np.int64)
    a.add_rollout("b0:x", r, order=0)
    a.add_score("b0:x", "reward", np.array([1, 2, 3, 4], dtype=np.float32))
    a.mark_ready("b0")
    first, second = a.take_step(), a.take_step()
    assert first is not None and second is not None and a.pending() == 0
    (_, one), (_, two) = first[0], second[0]
    assert one.task_ids == ["t0-0", "t0-1"] and one.rewards is not None and one.rewards.tolist() == [1.0, 2.0]
    assert two.task_ids == ["t0-2", "t0-3"] and two.rewards is not None and two.rewards.tolist() == [3.0, 4.0]
    assert one.ref_logprobs is None and isinstance(one.prompt_ids, np.ndarray)
