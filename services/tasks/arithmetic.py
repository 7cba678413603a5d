"""Verifiable arithmetic: "12+7=" -> "19", reward 1.0 on an exact match of the answer."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from services.tasks.base import BaseTask, Prompt, RewardFn, TaskError, TokenizerKind, require_int, validate_params

DEFAULTS: dict[str, Any] = {"max_operand": 20, "ops": "+"}
_OPS = "+-"


class ArithmeticTask(BaseTask):
    name = "arithmetic"
    tokenizer_kind: TokenizerKind = "char"
    own_reward_is_binary = True

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        reward_override: RewardFn | None = None,
        reward_override_name: str | None = None,
    ):
        super().__init__(reward_override, reward_override_name)
        p = validate_params(self.name, params or {}, DEFAULTS)
        self.max_operand = require_int(self.name, "max_operand", p["max_operand"], 1, 10**6)
        ops = p["ops"]
        if not isinstance(ops, str) or not ops or set(ops) - set(_OPS) or len(set(ops)) != len(ops):
            raise TaskError(
                f"task '{self.name}': param 'ops' must be a non-empty string of distinct characters from"
                f" {_OPS!r}, got {ops!r}"
            )
        self.ops = "".join(o for o in _OPS if o in ops)  # canonical order: "-+" and "+-" are one task
        self.params = {"max_operand": self.max_operand, "ops": self.ops}
        digits = len(str(self.max_operand))
        # a + op + b + "=".
        self.max_prompt_tokens = 2 * digits + 2
        # Longest answer (2 * max_operand, or a minus sign and max_operand digits) + EOS.
        longest = max(len(str(2 * self.max_operand)) if "+" in self.ops else 1,
                      1 + digits if "-" in self.ops else 1)
        self.max_new_tokens = longest + 1

    def _make(self, rng: random.Random, index: int) -> Prompt:
        a = rng.randint(0, self.max_operand)
        b = rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        answer = a + b if op == "+" else a - b
        return Prompt(index=index, text=f"{a}{op}{b}=", answer=str(answer))

    def _reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion.strip() == prompt.answer.strip() else 0.0

    def sft_example(self, index: int) -> tuple[str, str]:
        p = self._make(self._rng("sft", index), index)
        return p.text, p.answer

    def vocab(self) -> list[str]:
        return list("0123456789") + list(_OPS) + ["=", " "]
