"""Reward functions that misbehave on purpose, loaded by the fault suite through `task.reward_fn`."""

from __future__ import annotations

import time

from services.tasks.base import Prompt


def nan_for_index_8(prompt: Prompt, completion: str) -> float:
    if prompt.index == 8:
        return float("nan")
    return 1.0 if completion.strip() == prompt.answer else 0.0


def bad_rows(prompt: Prompt, completion: str) -> float:
    """Raises on one prompt in ten (index ending in 3) and returns NaN for prompt 8; exact match otherwise."""
    if prompt.index % 10 == 3:
        raise ValueError(f"cannot score prompt {prompt.index}")
    return nan_for_index_8(prompt, completion)


def hangs_on_index_5(prompt: Prompt, completion: str) -> float:
    """Never returns for prompt 5 (its process is killed on task.reward_timeout_s); exact match otherwise."""
    if prompt.index == 5:
        time.sleep(3600)
    return 1.0 if completion.strip() == prompt.answer else 0.0
