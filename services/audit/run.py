"""One audit of a run directory: open the journal read-only, replay the event log through the
invariant checks in order, scan the journal against what the log said, cross-check, report."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import lmdb

from services.audit.dropped import DropLedger
from services.audit.journal_scan import JournalScan, scan_journal
from services.audit.limits import AuditError, Limits, resolve_limits
from services.audit.report import AuditReport
from services.audit.resources import ResourceLedger
from services.audit.results import Checks, is_int
from services.audit.tasks import TaskLedger
from services.audit.versions import VersionLedger
from services.core.config.run import ConfigError, load_config
from services.core.journal.journal import Journal, JournalError, TaskState
from services.core.observability.events import EVENT_FIELDS, Event, EventReader

# Not an EVENT_FIELDS kind: the launcher may append it (with validate_kinds=False) when the
# controller exits 0 after its last step. Its presence means "finished" for auto-detection.
RUN_FINISHED_KIND = "run_finished"


def audit(
    run_dir: Path,
    *,
    finished: bool | None = None,
    limits: dict[str, Any] | None = None,
    journal: Journal | None = None,
) -> AuditReport:
    """Audit `run_dir` and return the report; never prints. Raises AuditError when the run cannot
    be audited.

    `finished`: None detects it (a `run_finished` event, or the journal's step >= run.max_steps);
    True treats every non-terminal task as lost; False allows in-flight tasks.
    `journal`: an already open handle to use instead of opening `RUN_DIR/journal` read-only (LMDB
    allows one handle per process, so an in-process caller that holds one passes it here); it is
    left open."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AuditError(f"run directory {run_dir} does not exist")
    lim, warnings = resolve_limits(run_dir, limits)
    owned = journal is None
    jdir = _journal_dir(run_dir)
    if journal is None:
        journal = _open_journal(jdir, lim)
    try:
        return _audit(run_dir, lim, journal, warnings, finished)
    except (JournalError, lmdb.Error) as err:
        raise AuditError(f"cannot read the journal {jdir}: {err}") from err
    finally:
        if owned:
            journal.close()


def _journal_dir(run_dir: Path) -> Path:
    """RUN_DIR/journal unless fleet.yaml moved it; a journal inside the run dir is found relative to
    `run_dir`, so a run audited through another mount point (a container volume) still finds it."""
    try:
        cfg = load_config(run_dir / "fleet.yaml")
    except (ConfigError, OSError):
        return run_dir / "journal"
    try:
        return run_dir / cfg.journal_dir.relative_to(cfg.run_dir)
    except ValueError:
        return cfg.journal_dir


def _open_journal(path: Path, lim: Limits) -> Journal:
    if not path.is_dir():
        raise AuditError(f"no journal at {path} (missing directory): is {path.parent} a run directory?")
    if not (path / "data.mdb").exists():
        raise AuditError(f"no journal at {path} (no data.mdb in it)")
    try:
        return Journal.open(path, readonly=True, stages=lim.stages, trainable=lim.trainable)
    except (JournalError, lmdb.Error, OSError) as err:
        raise AuditError(f"cannot open the journal {path} read-only: {err}") from err


class _EventPass:
    """The log, in order, handed to the ledger of each invariant family that the event's kind concerns."""

    def __init__(self, checks: Checks, lim: Limits) -> None:
        self.c = checks
        self.tasks = TaskLedger(checks, lim)
        self.versions = VersionLedger(checks)
        self.resources = ResourceLedger(checks, lim, self.tasks.admitted_ids)
        self.drops = DropLedger(checks, lim)
        self.kinds: Counter[str] = Counter()
        self.unknown_kinds: Counter[str] = Counter()
        self.run_finished = False

    def read(self, events: EventReader) -> None:
        for ev in events:
            self.kinds[ev.kind] += 1
            if ev.kind == RUN_FINISHED_KIND:
                self.run_finished = True
                continue
            need = EVENT_FIELDS.get(ev.kind)
            if need is None:
                self.unknown_kinds[ev.kind] += 1
                continue
            missing = [f for f in need if f not in ev.fields]
            if missing:
                self.c.malformed_event(ev, f"lacks fields {missing}")
                continue
            self._dispatch(ev)

    def _dispatch(self, ev: Event) -> None:
        if ev.kind == "admitted":
            new = self.tasks.on_admitted(ev)
            if new is not None:
                self.resources.on_admitted(new, ev.ts)
        elif ev.kind == "generated":
            self.tasks.on_generated(ev)
        elif ev.kind == "scored":
            self.tasks.on_scored(ev)
        elif ev.kind == "dead":
            tid = self.tasks.on_dead(ev)
            if tid is not None:
                self.resources.terminal(tid)
        elif ev.kind == "dropped":
            ids = self.tasks.on_dropped(ev)
            if ids is not None:
                self.drops.on_dropped(ids, ev.fields["reason"])
                for tid in ids:
                    self.resources.terminal(tid)
        elif ev.kind == "trained":
            step = self.tasks.on_trained(ev)
            if step is not None:
                for tid in step.task_ids:
                    self.resources.terminal(tid)
                self.versions.on_trained(step.step, step.version)
                self.drops.on_trained(step.step, step.task_ids)
        elif ev.kind == "version_served":
            self.versions.on_version_served(ev)
        elif ev.kind == "checkpoint":
            self.versions.on_checkpoint(ev)
        elif ev.kind == "resources":
            self.resources.on_resources(ev)


def _audit(run_dir: Path, lim: Limits, j: Journal, warnings: list[str], finished: bool | None) -> AuditReport:
    checks = Checks()
    # Whether the run finished is judged by the step read before the log; the scan reads it again after.
    step_before_log = j.step
    events_path = run_dir / "events.jsonl"
    if not events_path.exists():
        warnings.append(f"{events_path} not found: only the journal was checked")
    log = EventReader(events_path, quiet=True)  # the counts go into the report instead
    p = _EventPass(checks, lim)
    p.read(log)
    if log.unreadable:
        # The writer emits whole lines; an unreadable one in the middle means a second writer or
        # corruption, and the history the checks replay is incomplete.
        warnings.append(f"{log.unreadable} unreadable line(s) in the middle of {events_path.name} were skipped")
    if p.unknown_kinds:
        warnings.append(f"events of unknown kinds ignored: {dict(p.unknown_kinds)}")

    finished, why = _finished(finished, p.run_finished, step_before_log, lim.max_steps)
    n_event_ids = len(p.tasks.event_ids)  # before the scan consumes them
    scan = scan_journal(j, p.tasks, checks, finished, warnings, p.drops)
    p.drops.finish(j)
    if p.drops.missing_events:
        warnings.append(f"{p.drops.missing_events} dropped journal task(s) have no dropped event")
    tasks_by_state = _journal_tallies(j, scan, checks, finished, n_event_ids, warnings)
    checks[2].stats["trained tasks (journal)"] = tasks_by_state["trained"]
    checks[2].stats["tasks in trained events"] = p.tasks.trained_ids

    p.versions.check_steps(scan.journal_step, scan.trained_steps, warnings)
    p.versions.check_versions(j.versions)
    p.versions.check_replay(j, scan.journal_step, warnings)
    p.resources.finish(bool(scan.missing_trained_event or scan.missing_dead_event or p.drops.missing_events),
                       warnings)

    return AuditReport(
        run_dir=run_dir,
        finished=finished,
        finished_reason=why,
        limits=lim,
        steps={
            "journal": scan.journal_step,
            "trained events": p.versions.last_step,
            "metrics": _metrics_last_step(run_dir / "metrics.jsonl"),
            "run.max_steps": lim.max_steps,
        },
        tasks_by_state=tasks_by_state,
        dead_reasons=dict(scan.dead_reasons),
        in_flight=scan.in_flight_examples,
        event_log={
            "path": str(events_path),
            "exists": events_path.exists(),
            "events": sum(p.kinds.values()),
            "by_kind": dict(p.kinds),
            "torn_last_line": log.torn,
            "unreadable_lines": log.unreadable,
            "malformed": dict(checks.malformed),
        },
        checks=checks.ordered(),
        warnings=warnings,
    )


def _finished(told: bool | None, run_finished: bool, journal_step: int, max_steps: int) -> tuple[bool, str]:
    if told is not None:
        return told, "as told by the caller"
    if run_finished:
        return True, f"auto-detected: a {RUN_FINISHED_KIND} event"
    if journal_step >= max_steps:
        return True, f"auto-detected: journal step {journal_step} >= run.max_steps {max_steps}"
    return False, (
        f"auto-detected: journal step {journal_step} < run.max_steps {max_steps}, no {RUN_FINISHED_KIND} event"
    )


def _journal_tallies(
    j: Journal, scan: JournalScan, checks: Checks, finished: bool, n_event_ids: int, warnings: list[str]
) -> dict[str, int]:
    """Tasks by state, and the statistics and warnings about them that invariants 1 and 2 report."""
    tasks_by_state = {s.value: scan.states.get(s.value, 0) for s in TaskState}
    counters = j.counts()
    if counters != tasks_by_state and finished:
        # Only meaningful at rest: the chunked scan is not one snapshot while a controller writes.
        warnings.append(f"journal state counters {counters} disagree with its records {tasks_by_state}")
    n_in_flight = sum(tasks_by_state[s] for s in ("admitted", "generated", "scored"))
    c1 = checks[1]
    c1.stats["journal tasks"] = sum(tasks_by_state.values())
    c1.stats["task ids in events"] = n_event_ids
    c1.stats["in flight"] = n_in_flight
    if n_in_flight and not finished:
        c1.notes.append(f"{n_in_flight} task(s) in flight (allowed: the run is still going)")
    if scan.missing_trained_event:
        warnings.append(f"{scan.missing_trained_event} trained journal task(s) have no trained event")
    if scan.missing_dead_event:
        warnings.append(f"{scan.missing_dead_event} dead journal task(s) have no dead event")
    return tasks_by_state


def _metrics_last_step(path: Path) -> int | None:
    if not path.exists():
        return None
    last: int | None = None
    with path.open("rb") as f:
        for raw in f:
            try:
                row = json.loads(raw)
            except ValueError:
                continue  # a torn last line from a crash is never fatal
            if isinstance(row, dict) and is_int(row.get("step")):
                last = row["step"] if last is None else max(last, row["step"])
    return last
