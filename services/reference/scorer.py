"""Per-token log-probs of the rollout under the frozen initial policy, for the KL term."""

from __future__ import annotations

import torch
from torch import nn

from services.models.logprobs import compile_decoder, response_logprobs
from services.rl.batch import Rollout


class ReferenceScorer:
    def __init__(self, model: nn.Module, temperature: float, micro_batch: int = 0, chunk_tokens: int = 0,
                 compile: bool = False) -> None:
        self.model = model.eval().requires_grad_(False)
        self.temperature = temperature
        self.micro_batch = micro_batch
        self.chunk_tokens = chunk_tokens
        if compile:
            compile_decoder(self.model)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def score(self, r: Rollout) -> torch.Tensor:
        size = self.micro_batch or len(r)
        parts = []
        for idx in torch.arange(len(r)).split(size):
            mb = r.select(idx).to(self.device)
            out = response_logprobs(
                self.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                temperature=self.temperature, chunk_tokens=self.chunk_tokens,
            )
            parts.append((out if isinstance(out, torch.Tensor) else out[0]).cpu())
        return torch.cat(parts)
