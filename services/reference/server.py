"""The reference service: per-token log-probs of every rollout under the frozen initial policy."""

from __future__ import annotations

from pathlib import Path

from services.core.config.run import RunConfig
from services.models.io.loading import load_causal_lm
from services.models.nets.logprobs import warm_up_compiled
from services.reference.scorer import ReferenceScorer
from services.workers.scoring import ScoringService


def serve(cfg: RunConfig) -> None:
    assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
    model = load_causal_lm(Path(cfg.models.policy.path), dtype=cfg.models.policy.dtype,
                           device=cfg.endpoint("reference").device)
    a = cfg.algo
    scorer = ReferenceScorer(model, cfg.generation.temperature, micro_batch=a.micro_batch_size,
                             micro_tokens=a.micro_batch_tokens, pack=a.pack_sequences,
                             chunk_tokens=a.logprob_chunk_tokens, compile=a.compile,
                             tf32=a.tf32)
    # Before serving: the first batch then runs compiled code, and the compile overlaps the actor's
    # engine start (a few small batches: nothing vLLM's memory profiling would miss).
    warm_up_compiled("reference", scorer.warm_up)
    ScoringService(cfg, "reference", scorer.score).run()
