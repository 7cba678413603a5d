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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

TokenizerKind = Literal["char", "word"]
RewardFn = Callable[["Prompt", str], float]


class TaskError(ValueError):
    """A task that cannot be built or a reward that cannot be computed; the message says which and why."""


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    # The reference answer for verifiable tasks; "" for open-ended tasks (e.g. sentiment).
    answer: str


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

    def prompt(self, index: int) -> Prompt: ...

    def eval_prompt(self, index: int) -> Prompt: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...

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

    def __init__(self, reward_override: RewardFn | None = None, reward_override_name: str | None = None):
        self._reward_override = reward_override
        self._reward_override_name = reward_override_name or getattr(reward_override, "__name__", "reward_fn")

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

    def reward(self, prompt: Prompt, completion: str) -> float:
        if self._reward_override is None:
            return self._reward(prompt, completion)
        value = self._reward_override(prompt, completion)
        if isinstance(value, bool) or not isinstance(value, int | float):
            # Tensors and numpy scalars convert via float(); anything else is a bug in the override.
            try:
                value = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise TaskError(
                    f"reward_fn '{self._reward_override_name}' returned {type(value).__name__}, expected a float"
                ) from None
        out = float(value)
        if not math.isfinite(out):
            raise TaskError(f"reward_fn '{self._reward_override_name}' returned a non-finite reward {out}")
        return out
