"""Sequence rewards: the task's reward (its rule, a user function, or several weighted ones; see
services.tasks.rewards), or a reward model. A reward that cannot be computed (it raises, returns a
non-number or NaN/inf, or its row cannot be read) is a bad result, never a training signal.

The reward service scores with `score_rows`: the rows the reward fails on are isolated
(services.tasks.reward_rows) and named in the ScoreBatch, so only their tasks end dead; a batch it
cannot score at all (every row fails, the reward times out or its process dies, a row cannot be
read) raises `BadReward` with a named reason, and the worker dead-letters the batch so its tasks
end dead with that reason while the run goes on. The local loop's `score_with_components` raises
`BadReward` on any bad row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.core.ids import parse_task_id
from services.reward.worker import RewardStopped, RewardWorker
from services.rl.wire import RolloutArrays, StageScores
from services.tasks.base import Prompt, Task, TaskError
from services.tasks.reward_rows import RowScores, score_rows
from services.tasks.rewards import RewardError, RewardResult, RewardSet, make_component

if TYPE_CHECKING:  # torch only with a reward model: a reward function scores RolloutArrays (numpy)
    from services.core.config.run import RunConfig
    from services.rl.batch import Rollout

log = logging.getLogger("rlfleet.reward")


class BadReward(ValueError):
    reason = "non_finite_reward"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


RewardFn = Callable[[Prompt, str], float]


def reward_model_path(cfg: RunConfig) -> Path | None:
    spec = cfg.models.reward
    if spec is None:
        return None
    if spec.path is None or not Path(spec.path).is_dir():
        raise FileNotFoundError(f"models.reward.path: reward model directory not found: {spec.path}")
    return Path(spec.path)


class RewardScorer:
    def __init__(self, task: Task, tokenizer, fn: RewardFn | None = None, model_path: Path | None = None,  # type: ignore[no-untyped-def]
                 worker: RewardWorker | None = None):
        self.task = task
        self.tokenizer = tokenizer
        # Set: the task's reward runs in this child process, bounded in time (services.reward.worker).
        self.worker = worker
        # An explicit `fn` replaces the task's reward; otherwise the task scores (its reward set).
        self.rewards: RewardSet | None = (
            RewardSet([make_component(fn, getattr(fn, "__name__", "reward_fn"), 1.0, task.field_names)])
            if fn is not None else None)
        self.fn: RewardFn = self._one
        # Per-component means of the last batch scored (empty for a reward model).
        self.last_components: dict[str, float] = {}
        self.model = None
        if model_path is not None:
            from services.core.serving.entry import quiet_torch
            from services.models.roles.reward_model import load_reward_model

            quiet_torch()  # torch loads here, not at the service's start

            self.model = load_reward_model(model_path)

    def _one(self, prompt: Prompt, completion: str) -> float:
        return self.score_texts([prompt], [completion]).total[0]

    def score_texts(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> RewardResult:
        if self.rewards is not None:
            return self.rewards.score(prompts, completions)
        return self.task.score(prompts, completions)

    def completions(self, r: Rollout | RolloutArrays) -> list[str]:
        rows = [ids[m].tolist() for ids, m in zip(r.response_ids, r.response_mask, strict=True)]
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    def prompts(self, r: Rollout | RolloutArrays) -> list[Prompt]:
        out = []
        for tid in r.task_ids:
            index = parse_task_id(tid)[0]
            try:
                out.append(self.task.prompt(index))
            except TaskError as e:  # a data row that cannot be read
                raise BadReward(f"task {tid}: {e}", reason=getattr(e, "reason", "bad_prompt")) from None
        return out

    def score_with_components(self, r: Rollout | RolloutArrays) -> tuple[Any, dict[str, Any]]:
        """Rewards [B] and each component's unweighted values [B] (none for a reward model), float32:
        numpy arrays for RolloutArrays (a reward function's service imports no torch), tensors for a Rollout."""
        parts: dict[str, Any] = {}
        out: Any
        if self.model is not None:
            import torch

            rollout = r.to_rollout() if isinstance(r, RolloutArrays) else r
            with torch.no_grad():
                out = self.model.score_ids(rollout.input_ids, rollout.attention_mask).float()
        else:
            try:
                res = self.score_texts(self.prompts(r), self.completions(r))
            except RewardError as e:
                raise BadReward(str(e), reason=e.reason) from None
            except TaskError as e:  # e.g. a legacy reward that raised TaskError itself
                raise BadReward(str(e), reason="reward_error") from None
            out = np.asarray(res.total, dtype=np.float32)
            parts = {k: np.asarray(v, dtype=np.float32) for k, v in res.components.items()}
            self.last_components = res.means()
            if len(parts) > 1:
                log.info("reward components", extra={"rows": len(res.total), "components": self.last_components})
        bad = [(tid, float(v)) for tid, v in zip(r.task_ids, out.tolist(), strict=True) if not math.isfinite(v)]
        if bad:
            raise BadReward(f"reward is not finite for {len(bad)} task(s), first {bad[0][0]}: {bad[0][1]}")
        if isinstance(out, np.ndarray) and not isinstance(r, RolloutArrays):
            import torch

            out, parts = torch.from_numpy(out), {k: torch.from_numpy(v) for k, v in parts.items()}
        return out, parts

    def score(self, r: Rollout | RolloutArrays) -> Any:
        return self.score_with_components(r)[0]

    def score_rows(self, r: Rollout | RolloutArrays) -> StageScores:
        """The reward service's scoring: rewards [B], components, and the rows that could not be scored
        (numpy for RolloutArrays, as `score_with_components`)."""
        if self.model is not None:
            return StageScores(*self.score_with_components(r))
        prompts, texts = self.prompts(r), self.completions(r)
        try:
            rows: RowScores = (self.worker.score(prompts, texts) if self.worker is not None
                               else score_rows(self.score_texts, prompts, texts))
        except RewardStopped as e:
            raise BadReward(str(e), reason=e.reason) from None
        if rows.failed and not rows.scored:  # nothing to train on: the batch is dead-lettered whole
            first = rows.failed[min(rows.failed)]
            raise BadReward(f"no row of the batch could be scored; first: {first.message}", reason=first.reason)
        self.last_components = rows.means()
        total: Any = np.asarray(rows.total, dtype=np.float32)
        parts: dict[str, Any] = {k: np.asarray(v, dtype=np.float32) for k, v in rows.components.items()}
        if not isinstance(r, RolloutArrays):
            import torch

            total, parts = torch.from_numpy(total), {k: torch.from_numpy(v) for k, v in parts.items()}
        unscored = {r.task_ids[i]: f"{f.reason}: {f.message}" for i, f in sorted(rows.failed.items())}
        return StageScores(total, parts, unscored)
