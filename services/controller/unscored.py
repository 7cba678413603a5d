"""Rows the reward could not score (the ScoreBatch's `unscored`): their tasks end `dead` with the
reward's reason, and the batch's other groups train. A group trains whole or not at all: the other
rows of a group with an unscored row end `dead` too (`unscored_group`), since a group-relative
advantage over the rows that happened to score would be measured against a baseline that silently
lacks the failed one, and a step stays exactly `samples_per_step` rows of whole groups. Admission
replaces every dead task, as for any other.

A batch short of a group no longer adds up with whole batches to a step, so steps take groups and
may split a batch over two steps; the admission window's slack (RunConfig.admission_window) lets a
step that is one group short admit its next message. A leftover the next step may not train
(`flow.max_staleness`) ends `dropped` as `surplus` after the commit, as with dynamic sampling
(FleetSampling.after_commit): without a bad row, no batch is split and nothing is dropped."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.core.journal.task_records import TaskRecord

if TYPE_CHECKING:
    from services.controller.state import StepState

log = logging.getLogger("rlfleet.controller")

GROUP_REASON = "unscored_group"


async def end_unscored(ctl: StepState, pbid: str, recs: Sequence[TaskRecord | None]) -> set[str] | None:
    """End the batch's unscored rows and the rest of their groups (state lock held, every score
    in); idempotent, so a restart repairs a crash between the writes. Returns the tasks it ended,
    or None when no group is left to train: the join then forgets the batch."""
    unscored = ctl.assembler.unscored_of(pbid)
    if not unscored:
        return set()
    by_id = {r.task_id: r for r in recs if r is not None}
    groups = sorted({by_id[t].group_id for t in unscored if t in by_id})
    ctl.assembler.exclude(pbid, groups)
    ended: dict[str, str] = {}
    for tid, why in unscored.items():
        if tid in by_id and not by_id[tid].is_terminal:
            ended[tid] = why
    for g in groups:
        cause = next(t for t in sorted(unscored) if t in by_id and by_id[t].group_id == g)
        code = unscored[cause].split(":", 1)[0]
        for r in recs:
            if r is not None and r.group_id == g and r.task_id not in unscored and not r.is_terminal:
                ended[r.task_id] = (f"{GROUP_REASON}: task {cause} of its group could not be scored ({code});"
                                    " a group trains whole")
    by_reason: dict[str, list[str]] = {}
    for tid, why in ended.items():
        by_reason.setdefault(why[:500], []).append(tid)
    for why, tids in by_reason.items():
        await ctl.durable(ctl.journal.mark_dead, tids, why)
        for tid in tids:
            ctl.events.emit("dead", task_id=tid, reason=why)
    ctl.reward_parts.take(list(ended))  # never in a step's row: forget their reward components
    if ended:
        log.warning("unscored rows ended", extra={"batch_id": pbid, "unscored": len(unscored), "tasks": len(ended),
                                                   "groups": len(groups)})
    if not ctl.assembler.kept_groups(pbid):
        ctl.assembler.drop(pbid)
        ctl.progress.pop(pbid, None)
        return None
    return set(ended)
