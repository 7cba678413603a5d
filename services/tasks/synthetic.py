"""Synthetic throughput workload: prompts of exactly `prompt_tokens` random words over a word
vocabulary as large as a real model's, completions of a fixed budget.

Benchmarks use it so that rlfleet and a peer framework see the same token counts: every prompt is
`prompt_tokens` whitespace words `w<k>`, which the word-level tokenizer maps to one token each (no
BOS), and the vocabulary can be sized to the model's (151,936 for Qwen2.5) so any sampled id decodes.
The reward is cheap and rule-based (the share of completion words that also occur in the prompt), so
reward computation never dominates a throughput figure, yet it is a real, learnable signal.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from services.tasks.base import BaseTask, Prompt, RewardFn, TokenizerKind, require_int, validate_params

DEFAULTS: dict[str, Any] = {"prompt_tokens": 64, "completion_tokens": 256, "words": 1000}
# The word-level tokenizer's special tokens take ids 0..3; words follow.
N_SPECIAL = 4


class SyntheticTask(BaseTask):
    name = "synthetic"
    tokenizer_kind: TokenizerKind = "word"

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        reward_override: RewardFn | None = None,
        reward_override_name: str | None = None,
    ):
        super().__init__(reward_override, reward_override_name)
        p = validate_params(self.name, params or {}, DEFAULTS)
        self.prompt_tokens = require_int(self.name, "prompt_tokens", p["prompt_tokens"], 1, 32768)
        self.completion_tokens = require_int(self.name, "completion_tokens", p["completion_tokens"], 1, 32768)
        self.words = require_int(self.name, "words", p["words"], 2, 1_000_000)
        self.params = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                       "words": self.words}
        self.max_prompt_tokens = self.prompt_tokens
        self.max_new_tokens = self.completion_tokens

    def _words(self, rng: random.Random, n: int) -> list[str]:
        return [f"w{rng.randrange(self.words)}" for _ in range(n)]

    def _make(self, rng: random.Random, index: int) -> Prompt:
        return Prompt(index=index, text=" ".join(self._words(rng, self.prompt_tokens)), answer="")

    def _reward(self, prompt: Prompt, completion: str) -> float:
        words = completion.split()
        if not words:
            return 0.0
        seen = set(prompt.text.split())
        return sum(w in seen for w in words) / len(words)

    def sft_example(self, index: int) -> tuple[str, str]:
        rng = self._rng("sft", index)
        prompt = self._words(rng, self.prompt_tokens)
        # Echo words of the prompt: what the reward pays for.
        return " ".join(prompt), " ".join(rng.choice(prompt) for _ in range(min(8, self.completion_tokens - 1)))

    def vocab(self) -> list[str]:
        return [f"w{i}" for i in range(self.words)]
