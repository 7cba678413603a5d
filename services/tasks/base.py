"""What a task is: a deterministic prompt source, a reward, and what a tiny model needs to learn it.

Prompts are addressed by an integer index so the controller's dataset cursor (an int in the journal)
is all it takes to resume a run: `prompt(i)` is the i-th training prompt, `eval_prompt(i)` the i-th
evaluation prompt, drawn from a disjoint seed stream, and `sft_example(i)` the i-th supervised
warm-up pair, from a third stream. Every stream is seeded from a string (SHA-512 based in `random`),
so the same index gives the same prompt in every process regardless of `PYTHONHASHSEED`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

# Re-exported: the leaf module holds them so the reward code can use them without importing tasks.
from services.tasks.prompt import Prompt, PromptError, RewardFn, TaskError, TokenizerKind

if TYPE_CHECKING:
    from services.tasks.rewards import RewardResult, RewardSet

__all__ = ["BaseTask", "Prompt", "PromptError", "RewardFn", "Task", "TaskError", "TokenizerKind"]


@runtime_checkable
class Task(Protocol):
    name: str
    # Validated task parameters with defaults filled in (recorded next to built models).
    params: Mapping[str, Any]
    # How the tiny model's tokenizer splits text: one token per character or per whitespace word.
    tokenizer_kind: TokenizerKind
    # Upper bound on prompt length in tokens (the tiny models' tokenizers add no BOS).
    max_prompt_tokens: int
    # A sensible generation budget in tokens, counting the EOS token.
    max_new_tokens: int
    # Render prompts through the tokenizer's chat template (when it has one), with this system prompt.
    chat: bool
    system_prompt: str | None
    # Held-out prompts there are (eval_prompt(i) for i < eval_count); None: as many as asked.
    eval_count: int | None
    # The keywords a reward function receives besides the completion and the prompt.
    field_names: tuple[str, ...]

    def prompt(self, index: int) -> Prompt: ...

    def eval_prompt(self, index: int) -> Prompt: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...

    @property
    def correct_at(self) -> float | None: ...

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> RewardResult: ...

    def sft_example(self, index: int) -> tuple[str, str]: ...

    def vocab(self) -> list[str]: ...


def validate_params(
    task: str, params: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """Fill in defaults; an unknown key is an error naming the allowed ones."""
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        allowed = ", ".join(sorted(defaults))
        raise TaskError(f"task '{task}': unknown param(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    return {**defaults, **params}


def require_int(task: str, key: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TaskError(f"task '{task}': param '{key}' must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise TaskError(f"task '{task}': param '{key}' must be {bound}, got {value}")
    return value


def require_float(task: str, key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TaskError(f"task '{task}': param '{key}' must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise TaskError(f"task '{task}': param '{key}' must be in [{lo}, {hi}], got {value}")
    return float(value)


class BaseTask:
    """Shared plumbing: seeded streams per split and an optional reward override."""

    name: str = "base"
    params: Mapping[str, Any]
    tokenizer_kind: TokenizerKind
    max_prompt_tokens: int
    max_new_tokens: int
    chat: bool = True
    system_prompt: str | None = None
    eval_count: int | None = None
    field_names: tuple[str, ...] = ("answer",)

    def __init__(self, reward_override: RewardFn | None = None, reward_override_name: str | None = None):
        self._reward_override = reward_override
        self._reward_override_name = reward_override_name or getattr(reward_override, "__name__", "reward_fn")
        # The configured reward (one function or several with weights); None: the task's own.
        self.rewards: RewardSet | None = None

    # -- seeded streams ------------------------------------------------------------------------
    def _rng(self, split: str, index: int) -> random.Random:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TaskError(f"task '{self.name}': prompt index must be a non-negative int, got {index!r}")
        return random.Random(f"rlfleet/{self.name}/{split}/{index}")

    def _make(self, rng: random.Random, index: int) -> Prompt:
        raise NotImplementedError

    def prompt(self, index: int) -> Prompt:
        return self._make(self._rng("train", index), index)

    def eval_prompt(self, index: int) -> Prompt:
        return self._make(self._rng("eval", index), index)

    # -- reward --------------------------------------------------------------------------------
    def _reward(self, prompt: Prompt, completion: str) -> float:
        raise NotImplementedError

    def own_reward(self, prompt: Prompt, completion: str) -> float:
        """The task's built-in reward (`fn: task` in `task.rewards`)."""
        return self._reward(prompt, completion)

    def base_reward(self, prompt: Prompt, completion: str) -> float:
        """The constructor's override, else the task's own; unchecked (the reward set checks values)."""
        if self._reward_override is None:
            return self._reward(prompt, completion)
        return self._reward_override(prompt, completion)

    def reward_set(self) -> RewardSet:
        if self.rewards is None:
            from services.tasks.rewards import RewardSet

            self.rewards = RewardSet.of_task(self, str(self._reward_override_name) if self._reward_override else "task")
        return self.rewards

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> RewardResult:
        """Rewards of a batch, with each weighted component; a bad value raises `RewardError`."""
        return self.reward_set().score(prompts, completions)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.score([prompt], [completion]).total[0]

    # The task's own reward is 0/1 (1.0 = solved): reasoning-gym's score_answer, exact match.
    own_reward_is_binary: bool = False

    @property
    def correct_at(self) -> float | None:
        """The reward at or above which a completion counts as correct (held-out accuracy); None
        when the run's reward has no such notion (a user function, a weighted mix, a reward model)."""
        rs = self.rewards
        if rs is None:
            return 1.0 if self.own_reward_is_binary and self._reward_override is None else None
        if len(rs.components) != 1 or rs.components[0].weight != 1.0:
            return None
        from services.tasks.rewards import math_verify_reward

        fn = rs.components[0].fn
        binary = fn is math_verify_reward or (self.own_reward_is_binary and fn in (self.own_reward, self.base_reward)
                                              and self._reward_override is None)
        return 1.0 if binary else None
