"""The values tasks hand around: a prompt, the errors a bad row or reward raises. A leaf module, so
the task protocol (services.tasks.base) and the reward code (services.tasks.rewards) both build on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

TokenizerKind = Literal["char", "word"]
RewardFn = Callable[["Prompt", str], float]


class TaskError(ValueError):
    """A task that cannot be built or a reward that cannot be computed; the message says which and why."""


class PromptError(TaskError):
    """A data row that cannot become a prompt (e.g. a chat template that fails on it). At run time it
    ends that row's tasks dead with `reason` instead of stopping the run."""

    reason = "bad_prompt"

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    # The reference answer for verifiable tasks; "" for open-ended tasks (e.g. sentiment).
    answer: str
    # The conversation when the data holds chat messages rather than one string (`text` is then
    # the last user turn); rendered through the tokenizer's chat template.
    messages: tuple[Mapping[str, Any], ...] | None = field(default=None, hash=False)
    # The row's other columns under their (mapped) names, handed to reward functions as keywords.
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # Where the row came from ("train.jsonl row 17"), for error messages.
    origin: str = ""

    def reward_fields(self) -> dict[str, Any]:
        return {"answer": self.answer, **self.fields}

    def where(self) -> str:
        return self.origin or f"prompt {self.index}"
