"""Dynamic sampling in the fleet (DAPO, `algo.dynamic_sampling`): once every score of a prompt batch
is in, each of its groups whose rewards are all equal ends `dropped` in the journal, never trained,
and admission (whose window then counts only live groups) admits more prompts until the step has
`batch.prompts_per_step` kept groups; the step takes exactly those, in dataset order. A kept group a
step had no room for, and that the next step may not train (`flow.max_staleness`), is dropped as
surplus. Every decision is a journal write under the controller's state lock, made again the same
way from the journaled results after a restart, so a dropped group stays dropped and nothing is
trained twice."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from services.rl import dynamic_sampling as ds
from services.rl.dynamic_sampling import FILTERED, SURPLUS, filtered_reason, judge_groups

if TYPE_CHECKING:
    from services.controller.state import StepState
    from services.core.journal.journal import Journal

log = logging.getLogger("rlfleet.controller")


def check_bound(journal: Journal, step: int, group_size: int, prompts_per_step: int, max_rounds: int) -> None:
    """Raise when step `step` may not admit another prompt: the count is the journal's, so a
    restarted controller stops at the same place instead of starting the count over."""
    dropped = journal.dropped_for(step).get(FILTERED, 0) // group_size
    ds.check_bound(step, dropped, prompts_per_step, max_rounds)


class FleetSampling:
    def __init__(self, ctl: StepState) -> None:
        self.ctl = ctl
        self.tol = ctl.cfg.algo.dynamic_sampling_tol
        self.max_staleness = ctl.cfg.flow.max_staleness

    async def judge(self, pbid: str) -> None:
        """Drop the batch's all-equal groups, then what is too stale to train. Call with the state
        lock held, once its tasks are `scored`; idempotent."""
        a, step = self.ctl.assembler, self.ctl.journal.step
        r = a.rollout_of(pbid)
        kept = set(a.kept_groups(pbid))
        for v in judge_groups(a.scores_of(pbid)["reward"], r.group_ids, self.tol):
            if v.equal and v.group_id in kept:
                await self._drop(pbid, v.group_id, [r.task_ids[i] for i in v.rows], filtered_reason(v.value),
                                 step + 1, FILTERED)
        await self._drop_stale(pbid)

    async def after_commit(self) -> None:
        """A step committed: leftovers it made too stale leave the run. State lock held."""
        for pbid in self.ctl.assembler.batches():
            if self.ctl.assembler.is_ready(pbid):  # its tasks are `scored` in the journal
                await self._drop_stale(pbid)

    async def _drop_stale(self, pbid: str) -> None:
        """Kept groups the next step (training version = the journal's step) may not train."""
        a = self.ctl.assembler
        if a.rollout_id_of(pbid) is None:
            return  # every group of the batch was just dropped: the assembler no longer holds it
        r, version = a.rollout_of(pbid), self.ctl.journal.step
        versions = r.versions.tolist() if r.versions is not None else [r.version] * len(r)
        ended = version >= self.ctl.cfg.run.max_steps  # the last step is in: no step will train it
        for g in a.kept_groups(pbid):
            rows = [i for i, x in enumerate(r.group_ids.tolist()) if x == g]
            generated = min(int(versions[i]) for i in rows)
            if ended:
                reason = (f"{SURPLUS}: kept, but its step was full and the run ended at step {version}"
                          f" (run.max_steps)")
            elif version - generated > self.max_staleness:
                reason = (f"{SURPLUS}: kept, but its step was full; generated at version {generated}, the next"
                          f" step trains version {version} (flow.max_staleness {self.max_staleness})")
            else:
                continue
            await self._drop(pbid, g, [r.task_ids[i] for i in rows], reason, version, SURPLUS)

    async def _drop(self, pbid: str, group: int, task_ids: list[str], reason: str, step: int, kind: str) -> None:
        ctl = self.ctl
        moved = await ctl.durable(functools.partial(ctl.journal.mark_dropped, step=step, kind=kind), task_ids, reason)
        ctl.assembler.exclude(pbid, [group])
        ctl.reward_parts.take(task_ids)  # never in a step's row: forget their reward components
        if moved:
            ctl.events.emit("dropped", task_ids=moved, reason=reason, step=step)
            ctl.metrics.dropped_groups.labels(kind=kind).inc()
        if not ctl.assembler.kept_groups(pbid):
            ctl.assembler.drop(pbid)
            ctl.progress.pop(pbid, None)

    def step_stats(self, step: int) -> dict[str, float]:
        """The metrics row's dynamic-sampling figures for committed step `step`."""
        j, g = self.ctl.journal, self.ctl.cfg.algo.group_size
        dropped = j.dropped_for(step)
        prompts = j.prompts_for(step)
        self.ctl.metrics.step_prompts.set(prompts)
        return {"dropped_groups": float(dropped.get(FILTERED, 0) // g),
                "surplus_groups": float(dropped.get(SURPLUS, 0) // g), "admitted_prompts": float(prompts)}
