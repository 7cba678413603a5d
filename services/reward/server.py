"""The reward service: scores every rollout with the task's rule-based reward (or a `module:function`
override, or a reward model) and publishes the sequence rewards, naming the rows it could not score.

Only a reward model needs torch and transformers; a reward function decodes completions with the
`tokenizers` library alone (services.models.io.text_decoder) and scores numpy arrays, so the service
imports neither and starts in about a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.core.config.run import RunConfig
from services.reward.scorer import RewardScorer, reward_model_path
from services.reward.worker import RewardWorker
from services.tasks import load_task
from services.tasks.rewards import configured_reward
from services.workers.scoring import ScoringService


def _tokenizer(path: Path) -> Any:
    from services.models.io.text_decoder import TextDecoder

    decoder = TextDecoder.load(path)
    if decoder is not None:
        return decoder
    from services.models.io.loading import load_tokenizer  # a tokenizer without tokenizer.json: transformers'

    return load_tokenizer(path)


def serve(cfg: RunConfig) -> None:
    assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
    task = load_task(cfg.task)
    model_path = reward_model_path(cfg)
    # User code runs in a child process bounded by task.reward_timeout_s; started now, so it loads
    # the task while the service connects.
    worker = None
    if model_path is None and configured_reward(cfg.task):
        worker = RewardWorker(cfg.task, cfg.task.reward_timeout_s)
        worker.start()
    scorer = RewardScorer(task, _tokenizer(Path(cfg.models.policy.path)), model_path=model_path, worker=worker)
    try:
        ScoringService(cfg, "reward", scorer.score_rows, arrays=model_path is None).run()
    finally:
        if worker is not None:
            worker.close()
