"""Prompts from a reasoning-gym generator (basic_arithmetic, chain_sum, gsm_symbolic, countdown, ...),
scored by the generator's own `score_answer`.

A generator maps an item number to a problem deterministically for a given seed, so training index
i is item `eval_size + i % (size - eval_size)` and held-out index j is item `j`: the held-out
problems are a fixed slice that training never draws. `task.params` is the generator's config
(its own keys, e.g. min_terms, max_digits), plus `size` (items, default 100000) and `answer_tag`
(when set, the answer is read from `<tag>...</tag>` in the completion; otherwise the whole
completion, stripped, is the answer) or `answer_from: last_number` (the last number the completion
writes is the answer, as GSM8K-style graders read "The answer is 4."; a small chat model's sentences
then count for what they compute, not for their wording).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from services.tasks.base import BaseTask, Prompt, TaskError, TokenizerKind

if TYPE_CHECKING:
    from services.core.config.run import TaskSection

log = logging.getLogger("rlfleet.tasks.gym")

DEFAULT_SIZE = 100_000
ANSWER_FROM = ("completion", "last_number")
# A signed integer or decimal, thousands commas allowed ("-1,204.5").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def generator_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


class ReasoningGymTask(BaseTask):
    tokenizer_kind: TokenizerKind = "char"
    own_reward_is_binary = True
    field_names: tuple[str, ...] = ("answer", "metadata", "question")

    def __init__(self, section: TaskSection) -> None:
        super().__init__()
        try:
            import reasoning_gym
        except ImportError as err:
            raise TaskError(f"source 'reasoning_gym' needs the reasoning-gym package: {err}") from None
        assert section.name is not None
        self.section = section
        self.name = f"reasoning_gym:{section.name}"
        self.chat, self.system_prompt = section.chat, section.system_prompt
        params = dict(section.params)
        size = params.pop("size", DEFAULT_SIZE)
        self.answer_tag = params.pop("answer_tag", None)
        self.answer_from = params.pop("answer_from", "completion")
        if self.answer_from not in ANSWER_FROM:
            raise TaskError(f"task.params.answer_from: got {self.answer_from!r}; allowed values:"
                            f" {', '.join(map(repr, ANSWER_FROM))}")
        if self.answer_from != "completion" and self.answer_tag is not None:
            raise TaskError("task.params.answer_from and answer_tag exclude each other: set one")
        if isinstance(size, bool) or not isinstance(size, int) or size <= section.eval_size:
            raise TaskError(f"task.params.size must be an integer above task.eval_size ({section.eval_size}),"
                            f" got {size!r}")
        if self.answer_tag is not None and (not isinstance(self.answer_tag, str) or not self.answer_tag.isidentifier()):
            raise TaskError(f"task.params.answer_tag must be a tag name such as 'answer', got {self.answer_tag!r}")
        if section.name not in generator_names():
            raise TaskError(f"task.name: {section.name!r} is not a reasoning-gym generator; known: "
                            f"{', '.join(generator_names())}")
        try:
            self.dataset = reasoning_gym.create_dataset(section.name, seed=section.seed, size=size, **params)
        except TypeError as err:  # an unknown config key
            raise TaskError(f"task.params for reasoning-gym {section.name!r}: {err}") from None
        except (ValueError, AssertionError) as err:  # the generator's own config validation
            raise TaskError(f"task.params for reasoning-gym {section.name!r}: {err}") from None
        self.size = size
        self.eval_count = section.eval_size
        self.params = {"generator": section.name, "seed": section.seed, "size": size, "answer_tag": self.answer_tag,
                       "answer_from": self.answer_from,
                       "config": params, "system_prompt": section.system_prompt, "eval_size": section.eval_size}
        self.max_new_tokens = 64
        self.max_prompt_tokens = 512

    def _item(self, item: int, index: int) -> Prompt:
        try:
            entry: Mapping[str, Any] = self.dataset[item]
        except Exception as err:
            raise TaskError(f"reasoning-gym {self.section.name!r} item {item}: {type(err).__name__}: {err}") from err
        return Prompt(index=index, text=str(entry["question"]), answer=str(entry["answer"]),
                      fields={"metadata": entry.get("metadata", {}), "question": entry["question"]},
                      origin=f"reasoning-gym {self.section.name!r} item {item}")

    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TaskError(f"task '{self.name}': prompt index must be a non-negative int, got {index!r}")

    def prompt(self, index: int) -> Prompt:
        self._check_index(index)
        held = self.section.eval_size
        return self._item(held + index % (self.size - held), index)

    def eval_prompt(self, index: int) -> Prompt:
        self._check_index(index)
        if self.section.eval_size == 0:
            raise TaskError(f"task '{self.name}': no held-out prompts (task.eval_size is 0)")
        return self._item(index % self.section.eval_size, index)

    def extract(self, completion: str) -> str | None:
        if self.answer_from == "last_number":
            numbers = _NUMBER.findall(completion)
            return numbers[-1].rstrip(",") if numbers else None
        if self.answer_tag is None:
            return completion.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion, tag_name=self.answer_tag)

    def _reward(self, prompt: Prompt, completion: str) -> float:
        entry = {"question": prompt.fields.get("question", prompt.text), "answer": prompt.answer,
                 "metadata": prompt.fields.get("metadata", {})}
        return float(self.dataset.score_answer(self.extract(completion), entry))

    def sft_example(self, index: int) -> tuple[str, str]:
        from services.tasks.chat import raw_text

        p = self.prompt(index)
        answer = f"<{self.answer_tag}>{p.answer}</{self.answer_tag}>" if self.answer_tag else p.answer
        return raw_text(self, p), answer

    def vocab(self) -> list[str]:
        """Characters of a sample of problems and answers (for a tiny char-level model)."""
        chars: set[str] = set()
        for i in range(min(self.size, 2048)):
            q, a = self.sft_example(i)
            chars.update(q)
            chars.update(a)
        chars.update("0123456789-+*/=. ")
        return sorted(chars)
