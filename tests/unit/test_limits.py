"""Semantic validation (services/core/transport/limits.py): what the controller sends passes; every hostile
value of a well-formed message is a WireError whose message names the field."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from services.core.pb import rlfleet_pb2 as pb
from services.core.transport.codec import WireError
from services.core.transport.limits import Limits
from services.rl.batch import Rollout
from services.rl.wire import message, rollout_to_proto, score_from_proto, score_to_proto, validate_rollout_batch

LIMITS = Limits(vocab_size=18, max_version=10, max_new_tokens=4, max_prompt_tokens=60, group_size=2,
                prompts_per_message=2, samples_per_step=8, temperature=0.7)


def prompt_batch(first: int = 8) -> pb.PromptBatch:
    b = message(pb.PromptBatch, batch_id=f"b{first}", version=3, step=3,
                sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4,
                                           stop_token_ids=[2], seed=2**64 - 1))
    for i in range(first, first + 2):
        for k in range(2):
            b.prompts.add(task_id=f"t{i}-{k}", token_ids=[1, 17], dataset_index=i, sample_index=k, group_id=i)
    return b


def rollout(rows: int = 4, r: int = 4) -> Rollout:
    return Rollout(task_ids=[f"t{8 + i // 2}-{i % 2}" for i in range(rows)],
                   prompt_ids=torch.ones(rows, 3, dtype=torch.long), prompt_mask=torch.ones(rows, 3, dtype=torch.bool),
                   response_ids=torch.full((rows, r), 17), response_mask=torch.ones(rows, r, dtype=torch.bool),
                   behaviour_logprobs=torch.full((rows, r), -0.5), group_ids=torch.arange(rows) // 2, version=3)


def test_what_the_controller_sends_passes_and_zero_sampling_fields_mean_the_default() -> None:
    LIMITS.check_prompt_batch(prompt_batch())
    b = prompt_batch()
    b.sampling.Clear()  # proto3: unset and 0 are one; the actor fills in the run's defaults
    LIMITS.check_prompt_batch(b)
    validate_rollout_batch(rollout_to_proto(rollout(), "b8:x"), 1 << 20, LIMITS)


@pytest.mark.parametrize(("field", "change"), [
    ("version", lambda b: setattr(b, "version", 11)),
    ("version", lambda b: setattr(b, "version", -1)),
    ("step", lambda b: setattr(b, "step", -1)),
    ("sampling.temperature", lambda b: setattr(b.sampling, "temperature", -1.0)),
    ("sampling.temperature", lambda b: setattr(b.sampling, "temperature", math.inf)),
    ("sampling.temperature", lambda b: setattr(b.sampling, "temperature", 1.5)),  # not the run's
    ("sampling.top_p", lambda b: setattr(b.sampling, "top_p", math.nan)),
    ("sampling.top_k", lambda b: setattr(b.sampling, "top_k", -1)),
    ("sampling.max_new_tokens", lambda b: setattr(b.sampling, "max_new_tokens", 5)),
    ("sampling.stop_token_ids", lambda b: b.sampling.stop_token_ids.append(18)),
    ("token_ids", lambda b: b.prompts[1].token_ids.append(-4)),
    ("token_ids", lambda b: b.prompts[0].token_ids.extend([1] * 60)),
    ("token_ids", lambda b: b.prompts[0].ClearField("token_ids")),
    ("task_id", lambda b: setattr(b.prompts[0], "task_id", "t8-2")),
    ("task_id", lambda b: setattr(b.prompts[0], "task_id", "../t8-0")),
    ("task_id", lambda b: setattr(b.prompts[1], "task_id", "t8-0")),
    ("sample_index", lambda b: setattr(b.prompts[1], "sample_index", 0)),
    ("group_id", lambda b: setattr(b.prompts[1], "group_id", 2**63)),
    ("batch_id", lambda b: setattr(b, "batch_id", "b9")),
    ("batch_id", lambda b: setattr(b.prompts[3], "task_id", "t10-1") or setattr(b.prompts[3], "dataset_index", 10)),
    ("prompts", lambda b: b.ClearField("prompts")),
    ("prompts", lambda b: b.prompts.extend(prompt_batch(8).prompts)),
])
def test_a_hostile_prompt_batch_is_rejected_naming_the_field(field: str, change: Any) -> None:
    b = prompt_batch()
    change(b)
    with pytest.raises(WireError) as err:
        LIMITS.check_prompt_batch(b)
    assert field in str(err.value), str(err.value)


@pytest.mark.parametrize(("field", "change"), [
    ("response_ids", lambda r: r.response_ids.__setitem__((0, 0), 18)),
    ("prompt_ids", lambda r: r.prompt_ids.__setitem__((1, 2), -1)),
    ("group_ids", lambda r: r.group_ids.__setitem__(0, -5)),
    ("task_id", lambda r: r.task_ids.__setitem__(2, "t9-9")),
    ("version", lambda r: setattr(r, "version", 11)),
    ("versions", lambda r: setattr(r, "versions", torch.tensor([3, 3, 3, 12]))),
])
def test_a_hostile_rollout_is_rejected_naming_the_field(field: str, change: Any) -> None:
    r = rollout()
    change(r)
    with pytest.raises(WireError) as err:
        validate_rollout_batch(rollout_to_proto(r, "b8:x"), 1 << 20, LIMITS)
    assert field in str(err.value), str(err.value)


def test_rollout_rows_and_lengths_are_bounded_by_the_run() -> None:
    for r, field in ((rollout(rows=6), "task_ids"), (rollout(r=5), "response_ids")):
        with pytest.raises(WireError) as err:
            validate_rollout_batch(rollout_to_proto(r, "b8:x"), 1 << 20, LIMITS)
        assert field in str(err.value)
    msg = rollout_to_proto(rollout(), "b8:x")
    msg.finish_reasons[:] = ["stop", "stop", "stop", "../../etc"]
    with pytest.raises(WireError, match="finish_reasons"):
        validate_rollout_batch(msg, 1 << 20, LIMITS)


def test_a_score_batch_from_the_future_or_of_foreign_tasks_is_rejected() -> None:
    ok = score_to_proto("b8:x", "critic", rollout().task_ids, torch.zeros(4, 4), version=10)
    score_from_proto(ok, max_bytes=1 << 20, limits=LIMITS)
    future = score_to_proto("b8:x", "reward", rollout().task_ids, torch.zeros(4), version=11)
    with pytest.raises(WireError, match="version"):
        score_from_proto(future, max_bytes=1 << 20, limits=LIMITS)
    foreign = score_to_proto("b8:x", "reward", ["t8-0", "t8-1", "x", "t9-1"], torch.zeros(4))
    with pytest.raises(WireError, match="task_id"):
        score_from_proto(foreign, max_bytes=1 << 20, limits=LIMITS)
    wide = score_to_proto("b8:x", "reference", rollout().task_ids, torch.zeros(4, 9))
    with pytest.raises(WireError, match="ref_logprobs"):
        score_from_proto(wide, max_bytes=1 << 20, limits=LIMITS)


def test_reward_components_must_be_the_configured_rewards() -> None:
    import dataclasses

    limits = dataclasses.replace(LIMITS, reward_names=frozenset({"correct", "format"}))
    tids = [f"t{8 + i // 2}-{i % 2}" for i in range(4)]
    both = {"correct": torch.ones(4), "format": torch.zeros(4)}
    assert set(score_from_proto(score_to_proto("b8", "reward", tids, torch.ones(4), components=both),
                                max_bytes=1 << 20, limits=limits).components) == {"correct", "format"}
    foreign = score_to_proto("b8", "reward", tids, torch.ones(4), components={**both, "bonus": torch.ones(4)})
    with pytest.raises(WireError, match="reward_components bonus, correct, format are not the run's rewards"):
        score_from_proto(foreign, max_bytes=1 << 20, limits=limits)
    with pytest.raises(WireError, match="none \\(a single reward\\)"):
        score_from_proto(score_to_proto("b8", "reward", tids, torch.ones(4), components=both),
                         max_bytes=1 << 20, limits=LIMITS)
