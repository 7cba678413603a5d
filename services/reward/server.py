"""The reward service: scores every rollout with the task's rule-based reward (or a `module:function`
override, or a reward model) and publishes the sequence rewards, naming the rows it could not score."""

from __future__ import annotations

from pathlib import Path

from services.core.config import RunConfig
from services.core.scoring import ScoringService
from services.models.loading import load_tokenizer
from services.models.roles import reward_model_path
from services.reward.scorer import RewardScorer
from services.reward.worker import RewardWorker
from services.tasks import load_task
from services.tasks.rewards import configured_reward


def serve(cfg: RunConfig) -> None:
    assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
    task = load_task(cfg.task)
    model = reward_model_path(cfg)
    # User code runs in a child process bounded by task.reward_timeout_s; started now, so it loads
    # the task while the service connects.
    worker = None
    if model is None and configured_reward(cfg.task):
        worker = RewardWorker(cfg.task, cfg.task.reward_timeout_s)
        worker.start()
    scorer = RewardScorer(task, load_tokenizer(Path(cfg.models.policy.path)), model_path=model, worker=worker)
    try:
        ScoringService(cfg, "reward", scorer.score_rows).run()
    finally:
        if worker is not None:
            worker.close()
