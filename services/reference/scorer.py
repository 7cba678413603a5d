"""Per-token log-probs of the rollout under the frozen initial policy, for the KL term."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from services.models.nets.logprobs import (
    COMPILE_BACKEND,
    CompileCount,
    compile_decoder,
    response_logprobs,
    use_tf32,
    wants_compile,
)
from services.rl.batch import Rollout
from services.rl.micro import score_rows
from services.rl.packing import packed_logprobs
from services.rl.warmup import warm_up_rollouts


class ReferenceScorer:
    """`micro_batch` rows or `micro_tokens` tokens (packed with `pack`) per forward, as the trainers'
    `algo.micro_batch_size`, `micro_batch_tokens` and `pack_sequences`; `chunk_tokens`, `compile` and `tf32` as
    `algo.logprob_chunk_tokens`, `algo.compile` and `algo.tf32`."""

    def __init__(self, model: nn.Module, temperature: float, micro_batch: int = 0, micro_tokens: int = 0,
                 pack: bool = False, chunk_tokens: int = 0, compile: bool | None = False,
                 tf32: bool | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.temperature = temperature
        self.micro_batch, self.micro_tokens, self.pack = micro_batch, micro_tokens, pack
        self.chunk_tokens = chunk_tokens
        self.device = next(model.parameters()).device
        self.tf32 = use_tf32(tf32, self.device)
        self.compile_backend = COMPILE_BACKEND if wants_compile(compile, self.device) else None
        if self.compile_backend is not None:
            compile_decoder(self.model, self.compile_backend)

    def warm_up(self) -> bool:
        """Compile the scoring forward on small rollouts (`services.rl.warmup`); False, doing nothing,
        without compile."""
        if self.compile_backend is None:
            return False
        for r in warm_up_rollouts(int(cast(Any, self.model).config.vocab_size)):
            self._score(r)  # compiles here are the warm-up's purpose: not counted as news
        return True

    def _plain(self, mb: Rollout) -> torch.Tensor:
        out = response_logprobs(self.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                                compile_backend=self.compile_backend)
        return out if isinstance(out, torch.Tensor) else out[0]

    def _packed(self, mb: Rollout, bins: list[list[int]]) -> torch.Tensor:
        return packed_logprobs(self.model, mb, bins, temperature=self.temperature,
                               compile_backend=self.compile_backend)[0]

    def score(self, r: Rollout) -> torch.Tensor:
        compiles = CompileCount() if self.compile_backend is not None else None
        out = self._score(r)
        if compiles is not None:
            compiles.since("reference")
        return out

    @torch.no_grad()
    def _score(self, r: Rollout) -> torch.Tensor:
        return score_rows(r, self.device, self._plain, self._packed, size=self.micro_batch,
                          tokens=self.micro_tokens, pack=self.pack)
