"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2, eq. 11): a group whose responses all got
the same reward has zero group-relative advantage, so it would only dilute the batch; it is dropped
and more prompts are sampled until the step has its batch. Eq. 11 keeps groups with
0 < #correct < G; generalised here to any reward: a group is dropped when all its rewards are
equal within a tolerance.

The one rule the controller (fleet) and the local loop both apply, and the audit re-checks. It
judges the reward stage's own scores, before overlong shaping and any KL term, as DAPO filters on
accuracy. numpy, not torch: the controller and the audit judge without importing it (a torch
tensor of the local loop converts without a copy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.core.config.base import RunCannotContinue

if TYPE_CHECKING:
    from services.rl.batch import Rollout


@dataclass(frozen=True)
class GroupVerdict:
    group_id: int
    rows: list[int]  # row indices of the group's samples, in batch order
    equal: bool  # every reward within `tol` of every other: the group carries no signal
    value: float  # the group's mean reward (what the drop reason shows)


def judge_groups(rewards: Any, group_ids: Any, tol: float) -> list[GroupVerdict]:
    """One verdict per group, in order of first appearance in the batch (`rewards`, `group_ids`:
    [B] arrays, or CPU tensors)."""
    r, groups = np.asarray(rewards, dtype=np.float64), np.asarray(group_ids)
    if r.shape != groups.shape or r.ndim != 1:
        raise ValueError(f"rewards {tuple(r.shape)} and group_ids {tuple(groups.shape)} must be [B]")
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        rows.setdefault(int(g), []).append(i)
    out = []
    for g, idx in rows.items():
        v = r[idx]
        out.append(GroupVerdict(g, idx, all_equal(v, tol), float(v.mean())))
    return out


def all_equal(values: Any, tol: float) -> bool:
    """True when max - min <= tol: no response of the group is better than another."""
    v = np.asarray(values, dtype=np.float64)
    return bool(v.size == 0 or float(v.max() - v.min()) <= tol)


def filtered_reason(value: float) -> str:
    """The journal reason of a group dropped by the filter; the audit recognises it by its prefix."""
    return f"{FILTERED}: all rewards equal ({value:g})"


FILTERED = "filtered"  # reason prefix (and counter name) of a group dropped for equal rewards
SURPLUS = "surplus"  # reason prefix of a kept group its step had no room for and the next may not train


class DynamicSamplingExhausted(RunCannotContinue):
    """A step dropped as many all-equal groups as `algo.dynamic_sampling_max_rounds` allows and still
    lacks its batch: the run stops rather than sample forever or train on less."""


def check_bound(step: int, dropped_groups: int, prompts_per_step: int, max_rounds: int) -> None:
    """Raise when step `step`, having dropped `dropped_groups` all-equal groups, may not sample more."""
    if dropped_groups >= prompts_per_step * max_rounds:
        raise DynamicSamplingExhausted(
            f"dynamic sampling: step {step} dropped {dropped_groups} groups whose rewards were all equal and"
            f" still lacks its {prompts_per_step} prompts (the bound is algo.dynamic_sampling_max_rounds"
            f" {max_rounds} x batch.prompts_per_step): the prompts are too easy or too hard for the policy;"
            " raise the bound, or change the data or the reward")


@dataclass
class FilledStep:
    """What one step of the local loop sampled: its kept groups, in dataset order, and the counts."""

    groups: list[Rollout] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)  # kept rows' reward components
    filtered: int = 0  # groups dropped as all-equal
    surplus: int = 0  # kept groups beyond the step's batch (the fleet drops them as too stale)
    prompts: int = 0
    cursor: int = 0  # dataset index of the next message

    def stats(self) -> dict[str, float]:
        return {"dropped_groups": float(self.filtered), "surplus_groups": float(self.surplus),
                "admitted_prompts": float(self.prompts)}


def fill_step(step: int, cursor: int, prompts_per_step: int, prompts_per_message: int, tol: float, max_rounds: int,
              sample: Callable[[int], tuple[Rollout, dict[str, Any]]]) -> FilledStep:
    """The local loop's dynamic sampling, exactly as the fleet's controller decides it: sample whole
    messages from `cursor` on (`sample(first)` generates and scores one, returning its reward
    components), drop every all-equal group, and keep the first `prompts_per_step` other groups."""
    out = FilledStep(cursor=cursor)
    while len(out.groups) < prompts_per_step:
        check_bound(step, out.filtered, prompts_per_step, max_rounds)
        part, named = sample(out.cursor)
        out.cursor += prompts_per_message
        out.prompts += prompts_per_message
        assert part.rewards is not None
        for v in judge_groups(part.rewards, part.group_ids, tol):
            if v.equal:
                out.filtered += 1
            elif len(out.groups) == prompts_per_step:
                out.surplus += 1
            else:
                out.groups.append(part.select(v.rows))
                for name, values in named.items():
                    out.components.setdefault(name, []).extend(values[v.rows].tolist())
    return out
