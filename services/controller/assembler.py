"""Joins rollouts with their scores and decides which batches make the next training step.

Pure bookkeeping, no I/O: the controller feeds it what the journal and the streams deliver, and
rebuilds it from the journal after a restart. A prompt batch may be generated twice (redelivery
after an actor crash); the first rollout recorded wins and scores for any other are ignored, so a
task never counts twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.core.ids import prompt_batch_of
from services.rl.batch import Rollout


@dataclass
class _Entry:
    rollout_id: str
    rollout: Rollout
    order: int  # dataset index of the batch's first prompt: steps consume batches in this order
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: bool = False  # every score in AND the journal says `scored`: a step may take it


class StepAssembler:
    def __init__(self, stages: Sequence[str], samples_per_step: int) -> None:
        self.stages = list(stages)
        self.samples_per_step = samples_per_step
        self._by_batch: dict[str, _Entry] = {}
        self._early: dict[str, dict[str, torch.Tensor]] = {}  # scores that beat their rollout here

    def add_rollout(self, rollout_id: str, rollout: Rollout, order: int) -> bool:
        pb = prompt_batch_of(rollout_id)
        if pb in self._by_batch:
            return False
        e = _Entry(rollout_id, rollout, order)
        e.scores.update(self._early.pop(rollout_id, {}))
        self._by_batch[pb] = e
        return True

    def add_score(self, rollout_id: str, stage: str, value: torch.Tensor) -> bool:
        """Record a stage's result; False when it is a duplicate or belongs to a losing rollout."""
        if stage not in self.stages:
            raise ValueError(f"score for stage {stage!r}, which this run does not use ({self.stages})")
        e = self._by_batch.get(prompt_batch_of(rollout_id))
        if e is None:
            early = self._early.setdefault(rollout_id, {})
            if stage in early:
                return False
            early[stage] = value
            return True
        if e.rollout_id != rollout_id or stage in e.scores:
            return False
        e.scores[stage] = value
        return True

    def rollout_id_of(self, prompt_batch_id: str) -> str | None:
        e = self._by_batch.get(prompt_batch_id)
        return e.rollout_id if e else None

    def rollout_of(self, prompt_batch_id: str) -> Rollout:
        return self._by_batch[prompt_batch_id].rollout

    def has_all_scores(self, prompt_batch_id: str) -> bool:
        e = self._by_batch.get(prompt_batch_id)
        return e is not None and all(s in e.scores for s in self.stages)

    def mark_ready(self, prompt_batch_id: str) -> None:
        e = self._by_batch.get(prompt_batch_id)
        if e is not None and self.has_all_scores(prompt_batch_id):
            e.ready = True

    def complete(self) -> list[str]:
        """Batches a step may take, oldest first."""
        return sorted((pb for pb, e in self._by_batch.items() if e.ready), key=lambda pb: self._by_batch[pb].order)

    def drop(self, prompt_batch_id: str) -> None:
        """Forget a batch (its tasks went dead, or a resumed step already holds it)."""
        e = self._by_batch.pop(prompt_batch_id, None)
        if e is not None:
            self._early.pop(e.rollout_id, None)

    def pending(self) -> int:
        return len(self._by_batch)

    def take_step(self) -> list[tuple[str, Rollout]] | None:
        """The oldest complete batches adding up to exactly one step, scores attached; None if not
        enough are complete yet. Batches are removed from the assembler when taken."""
        chosen: list[str] = []
        n = 0
        for pb in self.complete():
            size = len(self._by_batch[pb].rollout)
            if n + size > self.samples_per_step:
                break
            chosen.append(pb)
            n += size
        if n != self.samples_per_step:
            return None
        out = []
        for pb in chosen:
            e = self._by_batch.pop(pb)
            r = e.rollout
            r.rewards = e.scores.get("reward")
            r.ref_logprobs = e.scores.get("reference")
            r.values = e.scores.get("critic")
            out.append((e.rollout_id, r))
        return out
