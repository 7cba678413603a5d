"""Invariants 1-3 as the journal holds them, cross-checked with what the event log said.

1. no loss: every journal record is `trained`, `dead` or `dropped`, a dead or dropped one with a
   non-empty reason (a run still going may hold records in flight); every task id an event named
   has a journal record; a `dead` event's task is dead in the journal (dropped ones: `dropped.py`).
2. exactly-once effect: a task in a `trained` event is `trained` in the journal, in the same step.
3. bounded staleness: `0 <= trained_version - generated_version <= flow.max_staleness` for every
   trained record, and the journal and the event agree on both versions.

The events are read before this scan and the controller commits to the journal before it emits,
so everything the log names is already in the journal when the scan reaches it. The journal may
be ahead of the log (a crash between commit and emit): a warning, never a violation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from services.audit.dropped import DropLedger
from services.audit.results import MAX_EXAMPLES, Checks
from services.audit.tasks import TaskLedger, Trained
from services.core.journal.journal import Journal, TaskRecord, TaskState


@dataclass
class JournalScan:
    journal_step: int = 0  # read after the scan: a live controller keeps committing steps
    states: Counter[str] = field(default_factory=Counter)
    dead_reasons: Counter[str] = field(default_factory=Counter)
    in_flight_examples: list[str] = field(default_factory=list)
    trained_steps: set[int] = field(default_factory=set)  # every journal task's trained_step
    missing_trained_event: int = 0  # trained in the journal, no trained event: the log is behind
    missing_dead_event: int = 0  # dead in the journal, no dead event: the log is behind


def scan_journal(j: Journal, tasks: TaskLedger, checks: Checks, finished: bool, warnings: list[str],
                 drops: DropLedger) -> JournalScan:
    """Every journal record against `tasks` (which it consumes), then the ids only the log knows."""
    c1, c3, c4 = checks[1], checks[3], checks[4]
    scan = JournalScan()
    missing_admitted_event = 0
    staleness: Counter[int] = Counter()
    for rec in j.iter_tasks():
        tid = rec.task_id
        scan.states[rec.state.value] += 1
        tasks.event_ids.discard(tid)
        if tid not in tasks.admitted_ids:
            missing_admitted_event += 1
        ev = tasks.trained.pop(tid, None)
        dead_reason = tasks.dead_events.get(tid)
        drops.on_record(rec)
        if dead_reason is not None and rec.state is not TaskState.DEAD:
            c1.fail(
                "dead_mismatch",
                f"dead event for task {tid!r} ({dead_reason!r}) but journal state is {rec.state.value}",
            )
        if rec.state is TaskState.DEAD:
            scan.dead_reasons[rec.reason or ""] += 1
            scan.missing_dead_event += dead_reason is None
            if not (rec.reason or "").strip():
                c1.fail("dead_without_reason", f"task {tid!r} is dead with reason {rec.reason!r}")
        elif rec.state not in (TaskState.TRAINED, TaskState.DROPPED):
            if finished:
                c1.fail(
                    "lost",
                    f"task {tid!r} is still {rec.state.value} (admitted at step {rec.admitted_step})"
                    " in a finished run",
                )
            elif len(scan.in_flight_examples) < MAX_EXAMPLES:
                scan.in_flight_examples.append(f"{tid} ({rec.state.value}, admitted at step {rec.admitted_step})")
        lag: int | None = None
        if rec.state is TaskState.TRAINED:
            scan.missing_trained_event += ev is None
            lag = _check_trained_record(rec, ev, tasks, checks)
            if rec.trained_step is not None:
                scan.trained_steps.add(rec.trained_step)
        elif ev is not None:
            checks[2].fail(
                "not_trained_in_journal",
                f"task {tid!r} is in the trained event of step {ev.step} but journal state is {rec.state.value}",
            )
            lag = tasks.event_staleness(tid, ev)
        if lag is not None:
            staleness[lag] += 1
    # Read the step only now: every trained_step seen in the (chunked, not snapshot) scan and in
    # the log was committed before this read, so neither can be beyond it in a healthy run.
    scan.journal_step = j.step
    for rec_step in sorted(s for s in scan.trained_steps if s > scan.journal_step):
        c4.fail(
            "step_beyond_journal", f"tasks trained in step {rec_step}, beyond the journal's step {scan.journal_step}"
        )
    # Task ids some event named that the journal never held: lost, whether running or not.
    for tid in sorted(tasks.event_ids):
        c1.fail("missing_from_journal", f"task {tid!r} appears in the event log but not in the journal")
    for tid, tev in tasks.trained.items():
        lag = tasks.event_staleness(tid, tev)
        if lag is not None:
            staleness[lag] += 1
    if missing_admitted_event:
        warnings.append(
            f"{missing_admitted_event} journal tasks have no admitted event (log behind journal, or written"
            " by a controller that does not emit events)"
        )
    c3.stats["staleness histogram"] = dict(sorted(staleness.items()))
    c3.stats["max staleness"] = max(staleness, default=None)
    c3.stats["max_staleness"] = tasks.lim.max_staleness
    return scan


def _check_trained_record(rec: TaskRecord, ev: Trained | None, tasks: TaskLedger, checks: Checks) -> int | None:
    c2, c3 = checks[2], checks[3]
    tid = rec.task_id
    if rec.trained_step is None or rec.trained_version is None or rec.generated_version is None:
        c3.fail(
            "incomplete_record",
            f"trained task {tid!r} lacks trained_step/trained_version/generated_version"
            f" ({rec.trained_step}/{rec.trained_version}/{rec.generated_version})",
        )
        return None if ev is None else tasks.event_staleness(tid, ev)
    if ev is not None:
        if ev.step != rec.trained_step:
            c2.fail(
                "step_mismatch",
                f"task {tid!r}: trained event says step {ev.step}, journal says step {rec.trained_step}",
            )
        if ev.version != rec.trained_version or (
            ev.generated_version is not None and ev.generated_version != rec.generated_version
        ):
            c3.fail(
                "version_mismatch",
                f"task {tid!r}: trained event says generated {ev.generated_version} / trained {ev.version},"
                f" journal says {rec.generated_version} / {rec.trained_version}",
            )
    tasks.judge_lag(tid, rec.generated_version, rec.trained_version, "journal")
    return rec.trained_version - rec.generated_version
