from __future__ import annotations

import torch

from services.controller.assembler import StepAssembler
from services.rl.batch import Rollout


def _rollout(first: int, n: int = 2) -> Rollout:
    return Rollout(
        task_ids=[f"t{first}-{k}" for k in range(n)],
        prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.ones(n, 3, dtype=torch.long), response_mask=torch.ones(n, 3, dtype=torch.bool),
        behaviour_logprobs=torch.zeros(n, 3), group_ids=torch.full((n,), first),
    )


def _score(a: StepAssembler, rid: str, n: int = 2) -> None:
    a.add_score(rid, "reward", torch.ones(n))
    a.add_score(rid, "reference", torch.zeros(n, 3))


def test_first_rollout_of_a_prompt_batch_wins_and_scores_of_the_loser_are_ignored() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=2)
    assert a.add_rollout("b0:aaa", _rollout(0), order=0)
    assert not a.add_rollout("b0:bbb", _rollout(0), order=0)
    assert not a.add_score("b0:bbb", "reward", torch.ones(2))
    assert a.add_score("b0:aaa", "reward", torch.ones(2))
    assert not a.add_score("b0:aaa", "reward", torch.ones(2)), "a duplicate score never counts twice"


def test_a_batch_is_taken_only_when_all_scores_are_in_and_marked_ready() -> None:
    a = StepAssembler(["reward", "reference"], samples_per_step=2)
    a.add_rollout("b0:x", _rollout(0), order=0)
    a.add_score("b0:x", "reward", torch.ones(2))
    assert a.take_step() is None
    a.add_score("b0:x", "reference", torch.zeros(2, 3))
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
