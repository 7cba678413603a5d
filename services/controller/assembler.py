"""Joins rollouts with their scores and decides which batches make the next training step.

Pure bookkeeping, no I/O: the controller feeds it what the journal and the streams deliver, and
rebuilds it from the journal after a restart. A prompt batch may be generated twice (redelivery
after an actor crash); the first rollout recorded wins and scores for any other are ignored, so a
task never counts twice.

A step is made of groups: groups that left the run (the reward could not score one of their rows;
with dynamic sampling, groups the filter dropped) and groups an earlier step took leave their batch
(`exclude`), so a batch may be split over two steps. Without dynamic sampling a step takes the kept
groups of the oldest complete batches; with it (`group_size` given) the first `samples_per_step` kept
samples in dataset order, waiting for every batch admitted before them (`expect`), so the fleet
picks exactly the groups the local loop picks.

Rollouts and scores are numpy arrays (`RolloutArrays`), as they come off the wire: the controller
never imports torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.core.ids import prompt_batch_of
from services.rl.batch import RolloutArrays

Array = np.ndarray[Any, Any]


@dataclass
class _Entry:
    order: int  # dataset index of the batch's first prompt: steps consume batches in this order
    rollout_id: str | None = None  # None: admitted, no rollout yet (`expect`)
    rollout: RolloutArrays | None = None
    scores: dict[str, Array] = field(default_factory=dict)
    ready: bool = False  # every score in AND the journal says `scored`: a step may take it
    gone: set[int] = field(default_factory=set)  # groups no longer in the run (dropped, trained)


class StepAssembler:
    def __init__(self, stages: Sequence[str], samples_per_step: int, group_size: int | None = None) -> None:
        self.stages = list(stages)
        self.samples_per_step = samples_per_step
        self.group_size = group_size  # set (dynamic sampling): steps take groups in dataset order
        self._by_batch: dict[str, _Entry] = {}
        self._early: dict[str, dict[str, Array]] = {}  # scores that beat their rollout here
        # Rollout id -> the rows its reward could not score (task id -> reason).
        self._unscored: dict[str, dict[str, str]] = {}

    def expect(self, prompt_batch_id: str, order: int) -> None:
        """A batch was admitted: with group steps, no later batch may fill a step before it."""
        self._by_batch.setdefault(prompt_batch_id, _Entry(order))

    def add_rollout(self, rollout_id: str, rollout: RolloutArrays, order: int) -> bool:
        pb = prompt_batch_of(rollout_id)
        e = self._by_batch.get(pb)
        if e is not None and e.rollout is not None:
            return False
        e = self._by_batch[pb] = e or _Entry(order)
        e.rollout_id, e.rollout = rollout_id, rollout
        e.scores.update(self._early.pop(rollout_id, {}))
        return True

    def add_score(self, rollout_id: str, stage: str, value: Array,
                  unscored: dict[str, str] | None = None) -> bool:
        """Record a stage's result (and the rows the reward could not score); False when it is a
        duplicate or belongs to a losing rollout."""
        if stage not in self.stages:
            raise ValueError(f"score for stage {stage!r}, which this run does not use ({self.stages})")
        if unscored:
            self._unscored.setdefault(rollout_id, dict(unscored))
        e = self._by_batch.get(prompt_batch_of(rollout_id))
        if e is None or e.rollout_id is None:  # no rollout yet (at most `expect`ed): keep it for it
            early = self._early.setdefault(rollout_id, {})
            if stage in early:
                return False
            early[stage] = value
            return True
        if e.rollout_id != rollout_id or stage in e.scores:
            return False
        e.scores[stage] = value
        return True

    def unscored_of(self, prompt_batch_id: str) -> dict[str, str]:
        """The rows of the batch's winning rollout that its reward could not score."""
        rid = self.rollout_id_of(prompt_batch_id)
        return self._unscored.get(rid, {}) if rid is not None else {}

    def rollout_id_of(self, prompt_batch_id: str) -> str | None:
        e = self._by_batch.get(prompt_batch_id)
        return e.rollout_id if e else None

    def rollout_of(self, prompt_batch_id: str) -> RolloutArrays:
        r = self._by_batch[prompt_batch_id].rollout
        assert r is not None, f"{prompt_batch_id} has no rollout yet"
        return r

    def scores_of(self, prompt_batch_id: str) -> dict[str, Array]:
        return self._by_batch[prompt_batch_id].scores

    def has_all_scores(self, prompt_batch_id: str) -> bool:
        e = self._by_batch.get(prompt_batch_id)
        return e is not None and e.rollout is not None and all(s in e.scores for s in self.stages)

    def kept_groups(self, prompt_batch_id: str) -> list[int]:
        """Groups of the batch still to be trained, in row order."""
        e = self._by_batch.get(prompt_batch_id)
        if e is None or e.rollout is None:
            return []
        return [g for g in dict.fromkeys(e.rollout.group_ids.tolist()) if g not in e.gone]

    def exclude(self, prompt_batch_id: str, groups: Sequence[int]) -> None:
        """Groups that left the run (dropped, or trained by a step): never taken again."""
        e = self._by_batch.get(prompt_batch_id)
        if e is not None:
            e.gone.update(int(g) for g in groups)

    def batches(self) -> list[str]:
        """Every batch it knows, oldest first."""
        return sorted(self._by_batch, key=lambda pb: self._by_batch[pb].order)

    def mark_ready(self, prompt_batch_id: str) -> None:
        e = self._by_batch.get(prompt_batch_id)
        if e is not None and self.has_all_scores(prompt_batch_id):
            e.ready = True

    def is_ready(self, prompt_batch_id: str) -> bool:
        e = self._by_batch.get(prompt_batch_id)
        return e is not None and e.ready

    def complete(self) -> list[str]:
        """Batches a step may take, oldest first."""
        return [pb for pb in self.batches() if self._by_batch[pb].ready]

    def drop(self, prompt_batch_id: str) -> None:
        """Forget a batch (its tasks went dead, or a resumed step already holds it)."""
        e = self._by_batch.pop(prompt_batch_id, None)
        if e is not None and e.rollout_id is not None:
            self._early.pop(e.rollout_id, None)
            self._unscored.pop(e.rollout_id, None)

    def pending(self) -> int:
        return len(self._by_batch)

    def take_step(self) -> list[tuple[str, RolloutArrays]] | None:
        """Kept groups of complete batches adding up to exactly one step, oldest batch first,
        scores attached; None if not enough are complete yet (with `in_order`: while a batch before
        them is not complete). Taken groups leave their batch; a batch is removed once none is left."""
        need, n = self.samples_per_step, 0
        chosen: list[tuple[str, list[int]]] = []
        for pb in self.batches():
            if n == need:
                break
            e = self._by_batch[pb]
            if not e.ready:
                if self.group_size is not None:
                    return None
                continue
            assert e.rollout is not None
            sizes = Counter(e.rollout.group_ids.tolist())
            take = []
            for g in self.kept_groups(pb):
                if n + sizes[g] <= need:
                    take.append(g)
                    n += sizes[g]
            if take:
                chosen.append((pb, take))
        if n < need:
            return None
        out = []
        for pb, groups in chosen:
            e = self._by_batch[pb]
            assert e.rollout is not None and e.rollout_id is not None
            wanted = set(groups)
            rows = [i for i, g in enumerate(e.rollout.group_ids.tolist()) if g in wanted]
            if len(rows) == len(e.rollout):  # the whole batch: no copy
                r = e.rollout
                r.rewards, r.ref_logprobs, r.values = (e.scores.get(s) for s in ("reward", "reference", "critic"))
            else:
                r = e.rollout.select(rows)
                idx = np.asarray(rows, dtype=np.int64)
                r.rewards, r.ref_logprobs, r.values = (
                    e.scores[s][idx] if s in e.scores else None for s in ("reward", "reference", "critic"))
            e.gone |= wanted
            if not self.kept_groups(pb):
                self.drop(pb)
            out.append((e.rollout_id, r))
        return out
