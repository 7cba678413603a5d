"""Sequence rewards: the task's rule-based function (or a `module:function` override), or a reward
model. A non-finite reward is a bad result, never a training signal: it raises `BadReward`."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from services.core.ids import parse_task_id
from services.rl.batch import Rollout
from services.tasks.base import Prompt, Task, TaskError


class BadReward(ValueError):
    reason = "non_finite_reward"


RewardFn = Callable[[Prompt, str], float]


class RewardScorer:
    def __init__(self, task: Task, tokenizer, fn: RewardFn | None = None, model_path: Path | None = None):  # type: ignore[no-untyped-def]
        self.task = task
        self.tokenizer = tokenizer
        self.fn: RewardFn = fn or task.reward
        self.model = None
        if model_path is not None:
            from services.models.reward_model import load_reward_model

            self.model = load_reward_model(model_path)

    def completions(self, r: Rollout) -> list[str]:
        rows = [ids[m].tolist() for ids, m in zip(r.response_ids, r.response_mask, strict=True)]
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    @torch.no_grad()
    def score(self, r: Rollout) -> torch.Tensor:
        if self.model is not None:
            out = self.model.score_ids(r.input_ids, r.attention_mask).float()
        else:
            texts = self.completions(r)
            vals = []
            for tid, text in zip(r.task_ids, texts, strict=True):
                prompt = self.task.prompt(parse_task_id(tid)[0])
                try:
                    vals.append(float(self.fn(prompt, text)))
                except TaskError as e:  # e.g. a `module:function` reward that returned NaN
                    raise BadReward(f"task {tid}: {e}") from None
            out = torch.tensor(vals, dtype=torch.float32)
        bad = [(tid, float(v)) for tid, v in zip(r.task_ids, out.tolist(), strict=True) if not math.isfinite(v)]
        if bad:
            raise BadReward(f"reward is not finite for {len(bad)} task(s), first {bad[0][0]}: {bad[0][1]}")
        return out
