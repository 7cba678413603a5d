"""The reward service: scores every rollout with the task's rule-based reward (or a `module:function`
override, or a reward model) and publishes the sequence rewards."""

from __future__ import annotations

from pathlib import Path

from services.core.config import RunConfig
from services.core.scoring import ScoringService
from services.models.loading import load_tokenizer
from services.models.roles import reward_model_path
from services.reward.scorer import RewardScorer
from services.tasks import load_task


def serve(cfg: RunConfig) -> None:
    assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
    task = load_task(cfg.task)
    scorer = RewardScorer(task, load_tokenizer(Path(cfg.models.policy.path)), model_path=reward_model_path(cfg))
    ScoringService(cfg, "reward", scorer.score_with_components).run()
