"""Invariants 1-3 as the event log tells them: which task ids events name, which tasks each
`trained` event counted (exactly once) and how stale each was when it was trained.

`TaskLedger` replays the task events in log order; `services.audit.journal_scan` then holds the
journal's records against what it gathered."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.audit.limits import Limits
from services.audit.results import Checks, is_int, task_ids
from services.core.observability.events import Event


@dataclass
class Trained:
    """Where the log says a task was trained: step, policy version, and the version it was generated at."""

    step: int
    version: int | None
    generated_version: int | None


@dataclass(frozen=True)
class TrainedStep:
    """A well-formed `trained` event: its step, policy version and task ids (each once)."""

    step: int
    version: int
    task_ids: list[str]


class TaskLedger:
    def __init__(self, checks: Checks, limits: Limits) -> None:
        self.c = checks
        self.lim = limits
        self.admitted_ids: set[str] = set()
        self.event_ids: set[str] = set()  # every task id any event names; shrinks as the journal confirms
        self.trained: dict[str, Trained] = {}  # first trained event of each task; the journal scan pops
        self.trained_ids = 0  # distinct task ids in trained events
        self.dead_events: dict[str, str] = {}

    def _named(self, ev: Event) -> list[str] | None:
        ids = task_ids(ev.fields["task_ids"])
        if ids is None:
            self.c.malformed_event(ev, "task_ids is not a list of strings")
            return None
        self.event_ids.update(ids)
        return ids

    def on_admitted(self, ev: Event) -> list[str] | None:
        """The task ids this event admits for the first time, or None when it is malformed."""
        ids = self._named(ev)
        if ids is None:
            return None
        new = [t for t in dict.fromkeys(ids) if t not in self.admitted_ids]
        self.admitted_ids.update(new)
        return new

    def on_generated(self, ev: Event) -> None:
        self._named(ev)

    def on_scored(self, ev: Event) -> None:
        self._named(ev)

    def on_dropped(self, ev: Event) -> list[str] | None:
        """The dropped task ids, or None when the event is malformed."""
        return self._named(ev)

    def on_dead(self, ev: Event) -> str | None:
        """The dead task's id, or None when the event is malformed."""
        tid, reason = ev.fields["task_id"], ev.fields["reason"]
        if not isinstance(tid, str) or not tid:
            self.c.malformed_event(ev, f"task_id {tid!r} is not a task id")
            return None
        self.event_ids.add(tid)
        if not isinstance(reason, str) or not reason.strip():
            self.c[1].fail("dead_without_reason", f"dead event for task {tid!r} has reason {reason!r}")
        self.dead_events.setdefault(tid, str(reason))
        return tid

    def on_trained(self, ev: Event) -> TrainedStep | None:
        """Invariants 2 and 3 for one `trained` event; its step for invariant 4, or None when malformed."""
        f = ev.fields
        step, version, gvs = f["step"], f["version"], f["generated_versions"]
        ids = self._named(ev)
        if ids is None:
            return None
        if not is_int(step) or not is_int(version):
            self.c.malformed_event(ev, f"step {step!r} / version {version!r} are not integers")
            return None
        per_task: dict[str, int | None]
        if isinstance(gvs, list) and len(gvs) == len(ids) and all(is_int(v) for v in gvs):
            per_task = dict(zip(ids, gvs, strict=True))
        elif isinstance(gvs, dict) and all(is_int(gvs.get(t)) for t in ids):
            per_task = {tid: gvs[tid] for tid in ids}
        else:
            self.c.malformed_in(
                ev.kind,
                3,
                f"trained event of step {step}: generated_versions must be {len(ids)} integers"
                " (one per task id) or a task id -> version dict",
            )
            per_task = dict.fromkeys(ids)
        # Invariant 2: a task counts in at most one step.
        for tid in [t for t, n in Counter(ids).items() if n > 1]:
            self.c[2].fail("duplicate_in_step", f"task {tid!r} appears {ids.count(tid)} times in step {step}")
        unique = list(dict.fromkeys(ids))
        for tid in unique:
            prev = self.trained.get(tid)
            if prev is not None:
                self.c[2].fail("trained_twice", f"task {tid!r} in trained events of step {prev.step} and step {step}")
                # The first occurrence is judged against the journal later; judge this one on its own.
                gv = per_task.get(tid)
                if gv is not None:
                    self.judge_lag(tid, gv, version, f"trained event of step {step}")
                continue
            self.trained[tid] = Trained(step, version, per_task.get(tid))
            self.trained_ids += 1
        return TrainedStep(step, version, unique)

    def event_staleness(self, tid: str, ev: Trained) -> int | None:
        """Invariant 3 for a task the log says was trained, judged on the event alone."""
        if ev.version is None or ev.generated_version is None:
            return None
        self.judge_lag(tid, ev.generated_version, ev.version, f"trained event of step {ev.step}")
        return ev.version - ev.generated_version

    def judge_lag(self, tid: str, generated: int, trained: int, where: str) -> None:
        lag = trained - generated
        if lag < 0:
            self.c[3].fail(
                "from_future",
                f"task {tid!r} ({where}): generated at version {generated}, newer than trained version {trained}",
            )
        elif lag > self.lim.max_staleness:
            self.c[3].fail(
                "stale",
                f"task {tid!r} ({where}): generated at version {generated}, trained at {trained}:"
                f" staleness {lag} > max_staleness {self.lim.max_staleness}",
            )
