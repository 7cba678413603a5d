"""`rlfleet audit`: check a finished or running run against the five journal invariants.

The audit reads two records of the run and cross-checks them:

* the task journal (`RUN_DIR/journal/`, LMDB, opened read-only): the source of truth for every
  task's state, the step counter, acknowledged versions, checkpoint steps and replay batches;
* the append-only event log (`RUN_DIR/events.jsonl`, read through `services.core.observability.events`): the
  history, in order, that lets the audit check properties a final state cannot show (a version that
  went backwards and forwards again, a queue that was once too deep, a task that counted twice).

Contract with the writer (the controller), which the cross-checks rely on: the controller commits
to the journal first and emits the matching event second. So the journal may be AHEAD of the log
(a crash between commit and emit loses at most that batch of events; reported as a warning), but
the log must never claim something the journal does not hold (a violation). In particular a
`version_served` event is emitted after the controller recorded the version with
`Journal.set_version`, and a `trained` event after `Journal.mark_trained` of the same step.

The invariants, each checked where its module says (docs/architecture.md has the whole picture):

1. no loss, 2. exactly-once effect, 3. bounded staleness: `tasks` (the log) and `journal_scan`
   (the journal against the log);
4. monotonic versions: `versions`;
5. bounded resources: `resources`, against the bounds of `limits`.

`run` drives one audit, `report` holds and prints the verdict, `cli` is the command. Exit codes of
`audit_main`: 0 every invariant holds, 1 at least one violation, 2 the run cannot be audited (no
journal, unreadable config, bad limits).
"""

from services.audit.cli import audit_main
from services.audit.limits import AuditError, Limits, resolve_limits, stream_class
from services.audit.report import EXIT_ERROR, EXIT_OK, EXIT_VIOLATION, AuditReport
from services.audit.results import INVARIANT_NAMES, CheckResult
from services.audit.run import RUN_FINISHED_KIND, audit

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_VIOLATION",
    "INVARIANT_NAMES",
    "RUN_FINISHED_KIND",
    "AuditError",
    "AuditReport",
    "CheckResult",
    "Limits",
    "audit",
    "audit_main",
    "resolve_limits",
    "stream_class",
]
