"""Reward functions that misbehave on purpose, loaded by the fault suite through `task.reward_fn`."""

from __future__ import annotations

from services.tasks.base import Prompt


def nan_for_index_8(prompt: Prompt, completion: str) -> float:
    if prompt.index == 8:
        return float("nan")
    return 1.0 if completion.strip() == prompt.answer else 0.0
