"""Dynamic sampling, checked under invariants 1 and 2.

1. A `dropped` task is terminal, with a reason, and was dropped for a reason the audit can verify
   from the records it holds: `filtered` (every reward of its group, in the reward stage's score
   record the journal keeps, equal within `algo.dynamic_sampling_tol`, and the whole group dropped)
   or `surplus` (generated more than `flow.max_staleness` versions before the step it was left
   for, or left over when the run's last step was in); a `dropped` event's task is dropped in the
   journal.
2. A trained step has a full batch: exactly `samples_per_step` tasks, whole groups of
   `algo.group_size` (known from the run's config)."""

from __future__ import annotations

from collections import Counter

from services.audit.limits import Limits
from services.audit.results import Checks
from services.core import ids
from services.core.journal.journal import Journal, TaskRecord, TaskState
from services.core.pb import rlfleet_pb2 as pb
from services.rl.dynamic_sampling import FILTERED, SURPLUS, all_equal
from services.rl.wire import WireError, parse_message, score_from_proto


class DropLedger:
    def __init__(self, checks: Checks, lim: Limits) -> None:
        self.c, self.lim = checks, lim
        self.events: dict[str, str] = {}  # task id -> reason of its dropped event
        self.filtered: dict[tuple[str, int], set[str]] = {}  # (rollout id, group) -> dropped task ids
        self.kinds: Counter[str] = Counter()
        self.missing_events = 0  # dropped in the journal, no dropped event: the log is behind

    # -- the log ------------------------------------------------------------------------------------
    def on_dropped(self, task_ids: list[str], reason: object) -> None:
        if not isinstance(reason, str) or not reason.strip():
            self.c[1].fail("dropped_without_reason", f"dropped event for {len(task_ids)} task(s) has reason {reason!r}")
        for tid in task_ids:
            self.events.setdefault(tid, str(reason))

    def on_trained(self, step: int, task_ids: list[str]) -> None:
        """Invariant 2: a full batch of whole groups."""
        if len(task_ids) != self.lim.samples_per_step:
            self.c[2].fail("partial_batch", f"step {step} trained {len(task_ids)} tasks, not samples_per_step"
                           f" {self.lim.samples_per_step}")
        if self.lim.group_size:
            per_group = Counter(ids.parse_task_id(t)[0] for t in task_ids if _is_task_id(t))
            torn = sorted(g for g, n in per_group.items() if n != self.lim.group_size)
            if torn:
                self.c[2].fail("partial_group", f"step {step} trained part of group(s) {torn[:5]} (group_size"
                               f" {self.lim.group_size})")

    # -- the journal --------------------------------------------------------------------------------
    def on_record(self, rec: TaskRecord) -> None:
        """Every journal record, during the scan."""
        reason = self.events.pop(rec.task_id, None)
        if reason is not None and rec.state is not TaskState.DROPPED:
            self.c[1].fail("dropped_mismatch", f"dropped event for task {rec.task_id!r} ({reason[:60]!r}) but"
                           f" journal state is {rec.state.value}")
        if rec.state is not TaskState.DROPPED:
            return
        # The controller journals a drop before it emits the event: a crash between the two leaves
        # the journal ahead of the log, and the replay of tasks in flight counts those tasks as live.
        self.missing_events += reason is None
        why = (rec.reason or "").strip()
        kind = why.split(":", 1)[0]
        self.kinds[kind or "(none)"] += 1
        if not why:
            self.c[1].fail("dropped_without_reason", f"task {rec.task_id!r} is dropped with reason {rec.reason!r}")
        elif rec.generated_version is None or rec.batch_id is None:
            self.c[1].fail("dropped_unscored", f"dropped task {rec.task_id!r} was never generated and scored")
        elif kind == FILTERED:
            self.filtered.setdefault((rec.batch_id, rec.group_id), set()).add(rec.task_id)
        elif kind == SURPLUS:
            trains = rec.dropped_step
            # Too stale for the step it was left for, or left when the run's last step was in.
            if trains is None or (trains - rec.generated_version <= self.lim.max_staleness
                                  and trains < self.lim.max_steps):
                self.c[1].fail("surplus_not_stale", f"task {rec.task_id!r} dropped as surplus, generated at version"
                               f" {rec.generated_version}, for a step training version {trains} (max_staleness"
                               f" {self.lim.max_staleness}): it could have been trained")
        else:
            self.c[1].fail("dropped_unknown_reason", f"task {rec.task_id!r} dropped for {why[:80]!r}")

    def finish(self, j: Journal) -> None:
        """Each filtered group against its reward record; then dropped events the journal never saw."""
        for (rid, group), dropped in sorted(self.filtered.items()):
            raw = j.get_result(rid, "reward")
            rewards = None
            if raw is not None:
                try:
                    sb = score_from_proto(parse_message(pb.ScoreBatch, raw, max_bytes=len(raw) + 1),
                                          max_bytes=len(raw) + 1)
                    rows = [i for i, t in enumerate(sb.task_ids) if _is_task_id(t) and ids.parse_task_id(t)[0] == group]
                    members = {sb.task_ids[i] for i in rows}
                    rewards = sb.tensor[rows] if rows else None
                except (WireError, ValueError) as err:
                    self.c[1].fail("dropped_unverifiable", f"reward record of {rid!r} unreadable: {err}"[:300])
                    continue
            if rewards is None:
                self.c[1].fail("dropped_unverifiable", f"group {group} of {rid!r} dropped as all-equal, but the"
                               " journal holds no reward record for it")
                continue
            if not all_equal(rewards, self.lim.dynamic_sampling_tol):
                self.c[1].fail("dropped_unequal", f"group {group} of {rid!r} dropped as all-equal, but its rewards"
                               f" are {sorted(set(rewards.tolist()))[:8]}")
            if members != dropped:
                self.c[1].fail("dropped_part_of_group", f"group {group} of {rid!r}: {len(dropped)} of its"
                               f" {len(members)} tasks dropped")
        for tid in sorted(self.events)[:10]:
            self.c[1].fail("missing_from_journal", f"task {tid!r} appears in a dropped event but not in the journal")
        self.c[1].stats["dropped tasks by reason"] = dict(self.kinds)


def _is_task_id(t: str) -> bool:
    try:
        ids.parse_task_id(t)
    except ValueError:
        return False
    return True
