"""The reference service: per-token log-probs of every rollout under the frozen initial policy."""

from __future__ import annotations

from pathlib import Path

from services.core.config import RunConfig
from services.core.scoring import ScoringService
from services.models.loading import load_causal_lm
from services.reference.scorer import ReferenceScorer


def serve(cfg: RunConfig) -> None:
    assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
    model = load_causal_lm(Path(cfg.models.policy.path), dtype=cfg.models.policy.dtype,
                           device=cfg.endpoint("reference").device)
    scorer = ReferenceScorer(model, cfg.generation.temperature, micro_batch=cfg.algo.micro_batch_size,
                             chunk_tokens=cfg.algo.logprob_chunk_tokens, compile=cfg.algo.compile)
    ScoringService(cfg, "reference", scorer.score).run()
