"""`rlfleet audit`: check a finished or running run against the five journal invariants.

The audit reads two records of the run and cross-checks them:

* the task journal (`RUN_DIR/journal/`, LMDB, opened read-only): the source of truth for every
  task's state, the step counter, acknowledged versions, checkpoint steps and replay batches;
* the append-only event log (`RUN_DIR/events.jsonl`, see `services.core.events`): the history, in
  order, that lets the audit check properties a final state cannot show (a version that went
  backwards and forwards again, a queue that was once too deep, a task that counted twice).

Contract with the writer (the controller), which the cross-checks rely on: the controller commits
to the journal first and emits the matching event second. So the journal may be AHEAD of the log
(a crash between commit and emit loses at most that batch of events; reported as a warning), but
the log must never claim something the journal does not hold (a violation). In particular a
`version_served` event is emitted after the controller recorded the version with
`Journal.set_version`, and a `trained` event after `Journal.mark_trained` of the same step.

Exit codes of `audit_main`: 0 every invariant holds, 1 at least one violation, 2 the run cannot be
audited (no journal, unreadable config, bad limits).

What each invariant checks, precisely (the report prints the same lines):

1. no loss: every journal record is `trained` or `dead`, and a dead one has a non-empty reason.
   For a run still going, non-terminal records are allowed and reported as in flight. Every task
   id named by any event (`admitted`, `generated`, `scored`, `trained`, `dead`) must have a
   journal record, finished or not. A `dead` event needs a non-empty reason and the journal must
   hold that task as dead.
2. exactly-once effect: no task id appears twice within one `trained` event nor in two `trained`
   events; a task in a `trained` event is `trained` in the journal, with the same `trained_step`.
3. bounded staleness: `0 <= trained_version - generated_version <= flow.max_staleness` for every
   trained journal record and every task of every `trained` event (`version` and
   `generated_versions`), and the journal and the event agree on both versions.
4. monotonic versions: per service (per `service[replica]` when a `replica` field is present),
   `version_served` never decreases and never falls below the version of a checkpoint that service
   already reported; `checkpoint` versions and steps never decrease; the highest version served
   by a service the journal tracks is <= `Journal.versions[service]` (the log never claims a
   version the journal did not acknowledge); `trained` event steps go 1, 2, 3... in log order with
   no repeat and no step backwards, and the union of event steps and journal `trained_step`s has
   no gap up to the journal's step counter (a step present only in the journal is a lost event,
   a warning); no event step is beyond the journal's step; the policy `version` of `trained`
   events never decreases; the journal holds the replay batch of every step after the oldest
   checkpoint of a trainable service (when it stores batches at all).
5. bounded resources: over every `resources` event, each queue depth, each service's RSS and the
   disk usage stay within the limits below; and tasks in flight, replayed from `admitted` /
   `trained` / `dead` events, never exceed the admission window.

Queue limits, from the run config (a depth is stream entries, what `Bus.stream_depths` reports;
every entry on prompts, rollouts and scores carries at least one in-flight task, so a bound in
tasks also bounds entries):

    window   = (flow.max_staleness + 1) * samples_per_step
                                   the admission bound of DESIGN.md; the controller admits a
                                   prompt message only while in_flight + its tasks <= window, so
                                   in flight never exceeds it (`limits["max_in_flight"]` overrides)
    prompts  <= window             entries not yet generated are tasks in flight
    rollouts <= flow.stream_capacity + window
                                   backpressure stops the actor at the high watermark (<= capacity
                                   per scoring group); what it had already taken, at most the
                                   window, can still land on top
    scores   <= window * len(stages)   one score entry per task and stage at most
    dead     unbounded             dead letters are kept for people; maximum reported
    other    <= flow.stream_capacity + window

each multiplied by `limits["queue_headroom"]` (default 1.0). `limits["queue_depth"]` replaces the
formula: an int for every stream, or a dict keyed by short stream name. A stream key such as
`rlfleet:<run>:rollouts:critic` is classified by its `prompts`/`rollouts`/`scores`/`dead` segment.
RSS is bounded only when `limits["rss_bytes"]` is given (int for every service, or dict per
service; an event's bare int is the emitting process, labelled `process`). Disk is bounded only
when `limits["disk_bytes"]` is given; an event's `disk_bytes` is an int, or a dict shaped like
`Journal.usage()` (its `file_bytes` is the usage; `map_size` is address space and
`disk_free_bytes` is free space, so neither counts), or any other dict, whose values are summed.
The lowest `disk_free_bytes` seen is reported.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from services.core.config import ConfigError, RunConfig, load_config
from services.core.events import EVENT_FIELDS, Event
from services.core.journal import Journal, JournalError, TaskRecord, TaskState

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_ERROR = 2
MAX_EXAMPLES = 10
# Not an EVENT_FIELDS kind: the launcher may append it (with validate_kinds=False) when the
# controller exits 0 after its last step. Its presence means "finished" for auto-detection.
RUN_FINISHED_KIND = "run_finished"

INVARIANT_NAMES: dict[int, str] = {
    1: "no loss",
    2: "exactly-once effect",
    3: "bounded staleness",
    4: "monotonic versions",
    5: "bounded resources",
}

_CHECKED: dict[int, str] = {
    1: "every journal task ends trained or dead(reason) (in flight allowed while running); every task id"
    " in any event has a journal record; dead events have a reason and match the journal",
    2: "no task twice within or across trained events; event step == journal trained_step",
    3: "0 <= trained_version - generated_version <= max_staleness in journal records and trained events;"
    " journal and events agree on both versions",
    4: "version_served per service never decreases nor drops below a reported checkpoint; checkpoint"
    " version/step never decrease; max served <= journal's acknowledged version; trained steps 1,2,3..."
    " without repeat or gap; trained policy version never decreases; replay batches kept after the"
    " oldest checkpoint",
    5: "queue depths, rss and disk within limits in every resources event; in-flight tasks replayed from"
    " events <= the admission window",
}

_LIMIT_KEYS = frozenset(
    {
        # Run-config values; used only when RUN_DIR/fleet.yaml is absent.
        "max_staleness",
        "stream_capacity",
        "max_steps",
        "samples_per_step",
        "stages",
        "trainable",
        # Resource limits; the run config has none.
        "queue_headroom",
        "queue_depth",
        "rss_bytes",
        "disk_bytes",
        "max_in_flight",
    }
)
_CONFIG_KEYS = ("max_staleness", "stream_capacity", "max_steps", "samples_per_step", "stages", "trainable")
_STREAM_CLASSES = ("prompts", "rollouts", "scores", "dead")


class AuditError(RuntimeError):
    """The run cannot be audited at all (exit code 2): no journal, unreadable config, bad limits."""


# -- results -------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    """One invariant's verdict: violations by code, the first few examples, statistics, notes."""

    number: int
    name: str
    checked: str
    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def total(self) -> int:
        return sum(self.violations.values())

    def fail(self, code: str, message: str) -> None:
        self.violations[code] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{code}: {message}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "name": self.name,
            "passed": self.passed,
            "checked": self.checked,
            "violations": dict(self.violations),
            "violation_count": self.total,
            "examples": self.examples,
            "stats": self.stats,
            "notes": self.notes,
        }


@dataclass(frozen=True)
class Limits:
    """The bounds the audit holds the run to, and where each came from."""

    max_staleness: int
    stream_capacity: int
    max_steps: int
    samples_per_step: int
    stages: tuple[str, ...]
    trainable: tuple[str, ...]
    queue_headroom: float = 1.0
    queue_depth: int | dict[str, int] | None = None
    rss_bytes: int | dict[str, int] | None = None
    disk_bytes: int | None = None
    max_in_flight: int | None = None
    source: str = "defaults"

    @property
    def window(self) -> int:
        """DESIGN.md's admission bound: `in_flight <= (max_staleness + 1) * batch`."""
        return (self.max_staleness + 1) * self.samples_per_step

    @property
    def in_flight_ceiling(self) -> int:
        return self.window if self.max_in_flight is None else self.max_in_flight

    def queue_limit(self, stream: str) -> int | None:
        """Most entries `stream` may hold; None: unbounded (dead letters)."""
        cls = stream_class(stream)
        if isinstance(self.queue_depth, int):
            return self.queue_depth
        if isinstance(self.queue_depth, dict):
            for key in (stream, cls):
                if key in self.queue_depth:
                    return self.queue_depth[key]
        ceiling = self.in_flight_ceiling
        base: int | None
        if cls == "prompts":
            base = ceiling
        elif cls == "scores":
            base = ceiling * max(1, len(self.stages))
        elif cls == "dead":
            base = None
        else:  # rollouts, and any stream we do not know: capacity plus what may land after the check
            base = self.stream_capacity + ceiling
        return None if base is None else math.ceil(base * self.queue_headroom)

    def rss_limit(self, service: str) -> int | None:
        if isinstance(self.rss_bytes, dict):
            return self.rss_bytes.get(service, self.rss_bytes.get("*"))  # "*": any service not named
        return self.rss_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "max_staleness": self.max_staleness,
            "stream_capacity": self.stream_capacity,
            "max_steps": self.max_steps,
            "samples_per_step": self.samples_per_step,
            "stages": list(self.stages),
            "trainable": list(self.trainable),
            "admission_window": self.window,
            "in_flight_ceiling": self.in_flight_ceiling,
            "queue_headroom": self.queue_headroom,
            "queue_limits": {c: self.queue_limit(c) for c in _STREAM_CLASSES},
            "queue_depth": self.queue_depth,
            "rss_bytes": self.rss_bytes,
            "disk_bytes": self.disk_bytes,
            "max_in_flight": self.max_in_flight,
        }


@dataclass
class AuditReport:
    run_dir: Path
    finished: bool
    finished_reason: str
    limits: Limits
    steps: dict[str, int | None]
    tasks_by_state: dict[str, int]
    dead_reasons: dict[str, int]
    in_flight: list[str]
    event_log: dict[str, Any]
    checks: list[CheckResult]
    warnings: list[str]

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_VIOLATION

    def check(self, number: int) -> CheckResult:
        return next(c for c in self.checks if c.number == number)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "ok": self.ok,
            "finished": self.finished,
            "finished_reason": self.finished_reason,
            "limits": self.limits.to_dict(),
            "steps": self.steps,
            "tasks_by_state": self.tasks_by_state,
            "dead_reasons": self.dead_reasons,
            "in_flight_examples": self.in_flight,
            "event_log": self.event_log,
            "checks": [c.to_dict() for c in self.checks],
            "warnings": self.warnings,
        }

    def render(self) -> str:
        lim = self.limits
        ev = self.event_log
        lines = [f"rlfleet audit: {self.run_dir}"]
        lines.append(
            f"config: {lim.source}; max_staleness {lim.max_staleness}, stream_capacity {lim.stream_capacity},"
            f" max_steps {lim.max_steps}, samples_per_step {lim.samples_per_step},"
            f" stages {','.join(lim.stages)}, trainable {','.join(lim.trainable)}"
        )
        lines.append(f"run: {'finished' if self.finished else 'still running'} ({self.finished_reason})")
        lines.append("steps: " + ", ".join(f"{k} {'-' if v is None else v}" for k, v in self.steps.items()))
        total = sum(self.tasks_by_state.values())
        by_state = ", ".join(f"{s} {n}" for s, n in self.tasks_by_state.items())
        lines.append(f"tasks: {total} ({by_state})")
        if self.dead_reasons:
            hist = ", ".join(f"{r!r}: {n}" for r, n in sorted(self.dead_reasons.items(), key=lambda x: -x[1]))
            lines.append(f"dead reasons: {hist}")
        lines.append(
            f"event log: {ev['events']} events ({ev['path']}),"
            f" torn last line: {'yes (skipped; not a violation)' if ev['torn_last_line'] else 'no'},"
            f" unreadable lines: {ev['unreadable_lines']}"
        )
        lines.append("")
        for c in self.checks:
            verdict = "PASS" if c.passed else "FAIL"
            head = f"{verdict}  {c.number}. {c.name}"
            if not c.passed:
                codes = ", ".join(f"{code} {n}" for code, n in sorted(c.violations.items()))
                head += f": {c.total} violation{'s' if c.total != 1 else ''} ({codes})"
            lines.append(head)
            lines.append(f"      checked: {c.checked}")
            if c.stats:
                lines.append("      " + "; ".join(f"{k} {_fmt(v)}" for k, v in c.stats.items()))
            for ex in c.examples:
                lines.append(f"      - {ex}")
            if c.total > len(c.examples):
                lines.append(f"      ... and {c.total - len(c.examples)} more")
            for note in c.notes:
                lines.append(f"      note: {note}")
        if self.warnings:
            lines.append("")
            lines.append("warnings:")
            lines.extend(f"  - {w}" for w in self.warnings)
        lines.append("")
        failed = [c for c in self.checks if not c.passed]
        if failed:
            n = sum(c.total for c in failed)
            names = ", ".join(f"{c.number}. {c.name}" for c in failed)
            lines.append(f"RESULT: FAIL ({n} violation{'s' if n != 1 else ''}: {names})")
        else:
            lines.append("RESULT: PASS (all five invariants hold)")
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def stream_class(stream: str) -> str:
    """`prompts`, `rollouts`, `scores`, `dead` or `other`, from a short name or a full stream key
    (`rlfleet:<run>:rollouts`, `rollouts:critic`, `queue_prompts`)."""
    parts = [p for chunk in stream.split(":") for p in chunk.split("_")]
    for cls in ("dead", "rollouts", "scores", "prompts"):
        if cls in parts:
            return cls
    return "other"


# -- configuration -------------------------------------------------------------------------------


def _int_limit(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise AuditError(f"limits[{name!r}] must be a non-negative integer, got {v!r}")
    return v


def resolve_limits(run_dir: Path, limits: dict[str, Any] | None) -> tuple[Limits, list[str]]:
    """Bounds from `RUN_DIR/fleet.yaml` when present, else from `limits`, else RunConfig defaults;
    resource limits only from `limits`. Returns the limits and warnings about where they came from."""
    given = dict(limits or {})
    unknown = sorted(set(given) - _LIMIT_KEYS)
    if unknown:
        raise AuditError(f"unknown limits {unknown}; known: {sorted(_LIMIT_KEYS)}")
    warnings: list[str] = []
    path = run_dir / "fleet.yaml"
    cfg_values: dict[str, Any]
    if path.exists():
        try:
            cfg = load_config(path)
        except ConfigError as err:
            raise AuditError(f"cannot read the run config: {err}") from None
        cfg_values = _config_values(cfg)
        source = str(path)
        # The run's own config wins: it is what the controller enforced. Say when a caller's
        # value disagrees, so nobody believes the audit used it.
        for key in _CONFIG_KEYS:
            if key in given and _norm(given[key]) != _norm(cfg_values[key]):
                warnings.append(f"limits[{key!r}]={given[key]!r} ignored: {path.name} says {cfg_values[key]!r}")
    else:
        cfg_values = _config_values(RunConfig())
        from_limits = [k for k in _CONFIG_KEYS if k in given]
        for key in from_limits:
            cfg_values[key] = given[key]
        defaulted = [k for k in _CONFIG_KEYS if k not in given]
        source = "no fleet.yaml: " + (f"limits for {', '.join(from_limits)}; " if from_limits else "")
        source += f"RunConfig defaults for {', '.join(defaulted)}" if defaulted else "nothing defaulted"
        warnings.append(
            f"{path} not found; bounds come from the limits passed in and RunConfig defaults"
            f" ({', '.join(defaulted) or 'none'} defaulted)"
        )
    queue_depth = given.get("queue_depth")
    if queue_depth is not None and not isinstance(queue_depth, int | dict):
        raise AuditError(f"limits['queue_depth'] must be an int or a dict stream -> int, got {queue_depth!r}")
    if isinstance(queue_depth, int):
        queue_depth = _int_limit("queue_depth", queue_depth)
    elif isinstance(queue_depth, dict):
        queue_depth = {str(k): _int_limit(f"queue_depth.{k}", v) for k, v in queue_depth.items()}
    rss = given.get("rss_bytes")
    if isinstance(rss, dict):
        rss = {str(k): _int_limit(f"rss_bytes.{k}", v) for k, v in rss.items()}
    elif rss is not None:
        rss = _int_limit("rss_bytes", rss)
    disk = given.get("disk_bytes")
    if disk is not None:
        disk = _int_limit("disk_bytes", disk)
    max_in_flight = given.get("max_in_flight")
    if max_in_flight is not None:
        max_in_flight = _int_limit("max_in_flight", max_in_flight)
    headroom = given.get("queue_headroom", 1.0)
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not headroom > 0:
        raise AuditError(f"limits['queue_headroom'] must be a positive number, got {headroom!r}")
    try:
        lim = Limits(
            max_staleness=_int_limit("max_staleness", cfg_values["max_staleness"]),
            stream_capacity=_int_limit("stream_capacity", cfg_values["stream_capacity"]),
            max_steps=_int_limit("max_steps", cfg_values["max_steps"]),
            samples_per_step=_int_limit("samples_per_step", cfg_values["samples_per_step"]),
            stages=tuple(str(s) for s in cfg_values["stages"]) or ("reward",),
            trainable=tuple(str(s) for s in cfg_values["trainable"]) or ("actor",),
            queue_headroom=float(headroom),
            queue_depth=queue_depth,
            rss_bytes=rss,
            disk_bytes=disk,
            max_in_flight=max_in_flight,
            source=source,
        )
    except TypeError as err:  # e.g. stages given as a number
        raise AuditError(f"bad limits: {err}") from None
    return lim, warnings


def _config_values(cfg: RunConfig) -> dict[str, Any]:
    return {
        "max_staleness": cfg.flow.max_staleness,
        "stream_capacity": cfg.flow.stream_capacity,
        "max_steps": cfg.run.max_steps,
        "samples_per_step": cfg.samples_per_step,
        "stages": list(cfg.stages()),
        "trainable": ["actor", "critic"] if cfg.algo.needs_critic else ["actor"],
    }


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple | list) else v


# -- helpers -------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN is not a number here


def _ranges(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted ints collapsed into inclusive (first, last) runs."""
    out: list[tuple[int, int]] = []
    for s in sorted(steps):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _span(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}..{b}"


def _ids(v: Any) -> list[str] | None:
    if isinstance(v, list) and all(isinstance(t, str) for t in v):
        return v
    return None


# Keys of `Journal.usage()` that are not disk the run occupies.
_NOT_USAGE = frozenset({"map_size", "disk_free_bytes", "used_bytes"})


def _disk_usage(v: Any) -> tuple[int | None, int | None]:
    """(bytes used, bytes free or None) from a `disk_bytes` field; (None, None) when malformed."""
    if _is_num(v):
        return (int(v), None) if v >= 0 else (None, None)
    if not isinstance(v, dict) or not all(_is_num(x) and x >= 0 for x in v.values()):
        return None, None
    free = v.get("disk_free_bytes")
    if "file_bytes" in v:  # Journal.usage(): the data file is what the journal occupies
        return int(v["file_bytes"]), None if free is None else int(free)
    return int(sum(x for k, x in v.items() if k not in _NOT_USAGE)), None if free is None else int(free)


class _LogReader:
    """The events of `path` up to its size when opened, with the counts `iter_events` does not give:
    whole lines, unreadable ones, and whether the last line is torn.

    Reading only up to the size seen at open keeps the counts consistent while a live controller
    appends. Parsing follows `services.core.events` (one JSON object with `ts` and `kind` per line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        self.unreadable = 0
        self.torn = False

    def __iter__(self) -> Iterator[Event]:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            left = os.fstat(f.fileno()).st_size
            for raw in f:
                if left <= 0:
                    return
                raw = raw[:left]
                left -= len(raw)
                if not raw.endswith(b"\n"):
                    # The last line of a file whose writer died (or is) mid-write: never acknowledged.
                    self.torn = True
                    return
                self.lines += 1
                ev = _parse_line(raw)
                if ev is None:
                    self.unreadable += 1
                    continue
                yield ev


def _parse_line(raw: bytes) -> Event | None:
    try:
        d = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(d, dict):
        return None
    ts, kind = d.pop("ts", None), d.pop("kind", None)
    if not isinstance(kind, str) or not _is_num(ts):
        return None
    return Event(kind, d, float(ts))


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
            if isinstance(row, dict) and _is_int(row.get("step")):
                last = row["step"] if last is None else max(last, row["step"])
    return last


# -- the audit -----------------------------------------------------------------------------------


@dataclass
class _JournalScan:
    states: Counter[str]
    dead_reasons: Counter[str]
    in_flight_examples: list[str]
    trained_steps: set[int]  # every journal task's trained_step
    missing_trained_event: int  # trained in the journal, no trained event: the log is behind
    missing_dead_event: int  # dead in the journal, no dead event: the log is behind


@dataclass
class _Trained:
    step: int
    version: int | None
    generated_version: int | None


class _Auditor:
    """One pass over the event log, one pass over the journal, then the cross-checks."""

    def __init__(self, run_dir: Path, limits: Limits, journal: Journal, warnings: list[str]) -> None:
        self.run_dir = run_dir
        self.lim = limits
        self.j = journal
        self.warnings = warnings
        self.c = {n: CheckResult(n, INVARIANT_NAMES[n], _CHECKED[n]) for n in INVARIANT_NAMES}
        # Re-read after the task scan (see read_journal): a live controller keeps committing steps.
        self.journal_step = journal.step
        # Event-derived state.
        self.kinds: Counter[str] = Counter()
        self.unknown_kinds: Counter[str] = Counter()
        self.malformed: Counter[str] = Counter()
        self.run_finished = False
        self.admitted_ids: set[str] = set()
        self.event_ids: set[str] = set()  # every task id any event names; shrinks as the journal confirms
        self.trained: dict[str, _Trained] = {}
        self.dead_events: dict[str, str] = {}
        self.event_steps: set[int] = set()
        self.trained_events = 0
        self.last_step = 0
        self.known_steps: set[int] = set()  # steps that happened, by the log or the journal
        self.last_trained_version: int | None = None
        self.served: dict[str, int] = {}
        self.ckpt_version: dict[str, int] = {}
        self.ckpt_step: dict[str, int] = {}
        self.terminal_ids: set[str] = set()
        self.in_flight = 0
        self.in_flight_max = 0
        self.in_flight_excess: list[str] = []
        self.in_flight_excess_count = 0
        self.queue_max: dict[str, int] = {}
        self.rss_max: dict[str, int] = {}
        self.disk_max: int | None = None
        self.disk_free_min: int | None = None
        self.resources_events = 0

    # -- events ------------------------------------------------------------------------------

    def read_events(self, log: _LogReader) -> None:
        for ev in log:
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
                self._malformed(ev, f"lacks fields {missing}")
                continue
            getattr(self, f"_on_{ev.kind}")(ev)

    def _malformed(self, ev: Event, why: str) -> None:
        # A malformed event may hide the very thing its invariant is about, so it fails that invariant.
        self.malformed[ev.kind] += 1
        number = {
            "admitted": 1,
            "generated": 1,
            "scored": 1,
            "dead": 1,
            "trained": 2,
            "checkpoint": 4,
            "version_served": 4,
            "resources": 5,
        }[ev.kind]
        self.c[number].fail("malformed_event", f"{ev.kind} event at ts {ev.ts}: {why}")

    def _named(self, ev: Event) -> list[str] | None:
        ids = _ids(ev.fields["task_ids"])
        if ids is None:
            self._malformed(ev, "task_ids is not a list of strings")
            return None
        self.event_ids.update(ids)
        return ids

    def _on_admitted(self, ev: Event) -> None:
        ids = self._named(ev)
        if ids is None:
            return
        for tid in ids:
            if tid not in self.admitted_ids:
                self.admitted_ids.add(tid)
                if tid not in self.terminal_ids:
                    self.in_flight += 1
        if self.in_flight > self.in_flight_max:
            self.in_flight_max = self.in_flight
        if self.in_flight > self.lim.in_flight_ceiling:
            self.in_flight_excess_count += 1
            if len(self.in_flight_excess) < MAX_EXAMPLES:
                self.in_flight_excess.append(
                    f"{self.in_flight} tasks in flight after the admitted event at ts {ev.ts}"
                    f" (ceiling {self.lim.in_flight_ceiling})"
                )

    def _on_generated(self, ev: Event) -> None:
        self._named(ev)

    def _on_scored(self, ev: Event) -> None:
        self._named(ev)

    def _terminal(self, tid: str) -> None:
        if tid not in self.terminal_ids:
            self.terminal_ids.add(tid)
            if tid in self.admitted_ids:
                self.in_flight -= 1

    def _on_dead(self, ev: Event) -> None:
        tid, reason = ev.fields["task_id"], ev.fields["reason"]
        if not isinstance(tid, str) or not tid:
            self._malformed(ev, f"task_id {tid!r} is not a task id")
            return
        self.event_ids.add(tid)
        if not isinstance(reason, str) or not reason.strip():
            self.c[1].fail("dead_without_reason", f"dead event for task {tid!r} has reason {reason!r}")
        self.dead_events.setdefault(tid, str(reason))
        self._terminal(tid)

    def _on_trained(self, ev: Event) -> None:
        f = ev.fields
        step, version, gvs = f["step"], f["version"], f["generated_versions"]
        ids = self._named(ev)
        if ids is None:
            return
        if not _is_int(step) or not _is_int(version):
            self._malformed(ev, f"step {step!r} / version {version!r} are not integers")
            return
        per_task: dict[str, int | None]
        if isinstance(gvs, list) and len(gvs) == len(ids) and all(_is_int(v) for v in gvs):
            per_task = dict(zip(ids, gvs, strict=True))
        elif isinstance(gvs, dict) and all(_is_int(gvs.get(t)) for t in ids):
            per_task = {tid: gvs[tid] for tid in ids}
        else:
            self.malformed[ev.kind] += 1
            self.c[3].fail(
                "malformed_event",
                f"trained event of step {step}: generated_versions must be {len(ids)} integers"
                " (one per task id) or a task id -> version dict",
            )
            per_task = dict.fromkeys(ids)
        # Invariant 2: a task counts in at most one step.
        dup = [t for t, n in Counter(ids).items() if n > 1]
        for tid in dup:
            self.c[2].fail("duplicate_in_step", f"task {tid!r} appears {ids.count(tid)} times in step {step}")
        for tid in dict.fromkeys(ids):
            prev = self.trained.get(tid)
            if prev is not None:
                self.c[2].fail("trained_twice", f"task {tid!r} in trained events of step {prev.step} and step {step}")
                # The first occurrence is judged against the journal later; judge this one on its own.
                gv = per_task.get(tid)
                if gv is not None:
                    self._judge_lag(tid, gv, version, f"trained event of step {step}")
                continue
            self.trained[tid] = _Trained(step, version, per_task.get(tid))
            self._terminal(tid)
        # Invariant 4: steps 1, 2, 3... in log order.
        self.trained_events += 1
        if step in self.event_steps:
            self.c[4].fail("step_repeat", f"a second trained event for step {step}")
        elif step < self.last_step:
            self.c[4].fail("step_backwards", f"trained event for step {step} after step {self.last_step}")
        self.event_steps.add(step)
        self.last_step = max(self.last_step, step)
        if self.last_trained_version is not None and version < self.last_trained_version:
            self.c[4].fail(
                "trained_version_backwards",
                f"step {step} trained policy version {version} after version {self.last_trained_version}",
            )
        self.last_trained_version = (
            version if self.last_trained_version is None else max(self.last_trained_version, version)
        )

    @staticmethod
    def _service_key(ev: Event) -> str | None:
        svc = ev.fields["service"]
        if not isinstance(svc, str) or not svc:
            return None
        replica = ev.fields.get("replica")
        return svc if replica is None else f"{svc}[{replica}]"

    def _on_version_served(self, ev: Event) -> None:
        key, v = self._service_key(ev), ev.fields["version"]
        if key is None or not _is_int(v):
            self._malformed(ev, f"service {ev.fields['service']!r} / version {v!r}")
            return
        last = self.served.get(key)
        if last is not None and v < last:
            self.c[4].fail("version_backwards", f"{key} served version {v} after serving version {last}")
        elif v < self.ckpt_version.get(key, -1):
            self.c[4].fail(
                "below_checkpoint",
                f"{key} served version {v}, older than its checkpoint of version {self.ckpt_version[key]}",
            )
        self.served[key] = v if last is None else max(last, v)

    def _on_checkpoint(self, ev: Event) -> None:
        key, v, step = self._service_key(ev), ev.fields["version"], ev.fields["step"]
        if key is None or not _is_int(v) or not _is_int(step):
            self._malformed(ev, f"service {ev.fields['service']!r} / version {v!r} / step {step!r}")
            return
        lv, ls = self.ckpt_version.get(key), self.ckpt_step.get(key)
        if lv is not None and v < lv:
            self.c[4].fail("checkpoint_backwards", f"{key} checkpoint of version {v} after one of version {lv}")
        if ls is not None and step < ls:
            self.c[4].fail("checkpoint_backwards", f"{key} checkpoint at step {step} after one at step {ls}")
        self.ckpt_version[key] = v if lv is None else max(lv, v)
        self.ckpt_step[key] = step if ls is None else max(ls, step)

    def _on_resources(self, ev: Event) -> None:
        self.resources_events += 1
        c5 = self.c[5]
        depths = ev.fields["queue_depths"]
        if not isinstance(depths, dict):
            self._malformed(ev, "queue_depths is not a dict stream -> depth")
        else:
            for stream, depth in depths.items():
                if not _is_int(depth) or depth < 0:
                    self._malformed(ev, f"queue depth of {stream!r} is {depth!r}")
                    continue
                self.queue_max[stream] = max(self.queue_max.get(stream, 0), depth)
                limit = self.lim.queue_limit(stream)
                if limit is not None and depth > limit:
                    c5.fail("queue_over_limit", f"{stream} depth {depth} > {limit} at ts {ev.ts}")
        rss = ev.fields["rss_bytes"]
        rss_map = {"process": rss} if not isinstance(rss, dict) else rss
        for svc, b in rss_map.items():
            if not _is_num(b) or b < 0:
                self._malformed(ev, f"rss of {svc!r} is {b!r}")
                continue
            self.rss_max[svc] = max(self.rss_max.get(svc, 0), int(b))
            limit = self.lim.rss_limit(svc)
            if limit is not None and b > limit:
                c5.fail("rss_over_limit", f"{svc} rss {int(b)} bytes > {limit} at ts {ev.ts}")
        disk = ev.fields["disk_bytes"]
        used, free = _disk_usage(disk)
        if used is None:
            self._malformed(ev, f"disk_bytes is {disk!r}")
            return
        if free is not None:
            self.disk_free_min = free if self.disk_free_min is None else min(self.disk_free_min, free)
        total = used
        self.disk_max = total if self.disk_max is None else max(self.disk_max, total)
        if self.lim.disk_bytes is not None and total > self.lim.disk_bytes:
            c5.fail("disk_over_limit", f"disk {total} bytes > {self.lim.disk_bytes} at ts {ev.ts}")

    # -- journal -----------------------------------------------------------------------------

    def read_journal(self, finished: bool) -> _JournalScan:
        c1, c2, c3, c4 = self.c[1], self.c[2], self.c[3], self.c[4]
        states: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        in_flight: list[str] = []
        journal_steps: set[int] = set()
        missing_trained_event = 0
        missing_admitted_event = 0
        missing_dead_event = 0
        staleness: Counter[int] = Counter()
        # The events were read before this scan and the controller commits to the journal before it
        # emits, so everything the log names is already in the journal when the scan reaches it.
        for rec in self.j.iter_tasks():
            tid = rec.task_id
            states[rec.state.value] += 1
            self.event_ids.discard(tid)
            if tid not in self.admitted_ids:
                missing_admitted_event += 1
            ev = self.trained.pop(tid, None)
            dead_reason = self.dead_events.get(tid)
            if dead_reason is not None and rec.state is not TaskState.DEAD:
                c1.fail(
                    "dead_mismatch",
                    f"dead event for task {tid!r} ({dead_reason!r}) but journal state is {rec.state.value}",
                )
            if rec.state is TaskState.DEAD:
                reasons[rec.reason or ""] += 1
                missing_dead_event += dead_reason is None
                if not (rec.reason or "").strip():
                    c1.fail("dead_without_reason", f"task {tid!r} is dead with reason {rec.reason!r}")
            elif rec.state is not TaskState.TRAINED:
                if finished:
                    c1.fail(
                        "lost",
                        f"task {tid!r} is still {rec.state.value} (admitted at step {rec.admitted_step})"
                        " in a finished run",
                    )
                elif len(in_flight) < MAX_EXAMPLES:
                    in_flight.append(f"{tid} ({rec.state.value}, admitted at step {rec.admitted_step})")
            if rec.state is TaskState.TRAINED:
                missing_trained_event += ev is None
                lag = self._check_trained_record(rec, ev)
                if lag is not None:
                    staleness[lag] += 1
                if rec.trained_step is not None:
                    journal_steps.add(rec.trained_step)
            elif ev is not None:
                c2.fail(
                    "not_trained_in_journal",
                    f"task {tid!r} is in the trained event of step {ev.step} but journal state is {rec.state.value}",
                )
                lag = self._check_event_staleness(tid, ev)
                if lag is not None:
                    staleness[lag] += 1
        # Read the step only now: every trained_step seen in the (chunked, not snapshot) scan and in
        # the log was committed before this read, so neither can be beyond it in a healthy run.
        self.journal_step = self.j.step
        for rec_step in sorted(s for s in journal_steps if s > self.journal_step):
            c4.fail(
                "step_beyond_journal",
                f"tasks trained in step {rec_step}, beyond the journal's step {self.journal_step}",
            )
        # Task ids some event named that the journal never held: lost, whether running or not.
        for tid in sorted(self.event_ids):
            c1.fail("missing_from_journal", f"task {tid!r} appears in the event log but not in the journal")
        for tid, ev in self.trained.items():
            lag = self._check_event_staleness(tid, ev)
            if lag is not None:
                staleness[lag] += 1
        if missing_admitted_event:
            self.warnings.append(
                f"{missing_admitted_event} journal tasks have no admitted event (log behind journal, or written"
                " by a controller that does not emit events)"
            )
        c3.stats["staleness histogram"] = dict(sorted(staleness.items()))
        c3.stats["max staleness"] = max(staleness, default=None)
        c3.stats["max_staleness"] = self.lim.max_staleness
        return _JournalScan(states, reasons, in_flight, journal_steps, missing_trained_event, missing_dead_event)

    def _check_trained_record(self, rec: TaskRecord, ev: _Trained | None) -> int | None:
        c2, c3 = self.c[2], self.c[3]
        tid = rec.task_id
        if rec.trained_step is None or rec.trained_version is None or rec.generated_version is None:
            c3.fail(
                "incomplete_record",
                f"trained task {tid!r} lacks trained_step/trained_version/generated_version"
                f" ({rec.trained_step}/{rec.trained_version}/{rec.generated_version})",
            )
            return None if ev is None else self._check_event_staleness(tid, ev)
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
        lag = rec.trained_version - rec.generated_version
        self._judge_lag(tid, rec.generated_version, rec.trained_version, "journal")
        return lag

    def _check_event_staleness(self, tid: str, ev: _Trained) -> int | None:
        if ev.version is None or ev.generated_version is None:
            return None
        self._judge_lag(tid, ev.generated_version, ev.version, f"trained event of step {ev.step}")
        return ev.version - ev.generated_version

    def _judge_lag(self, tid: str, generated: int, trained: int, where: str) -> None:
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

    # -- cross-checks after both passes ------------------------------------------------------

    def check_steps(self, journal_steps: set[int]) -> None:
        c4 = self.c[4]
        event_steps = self.event_steps
        top = max([self.journal_step, *event_steps, *journal_steps], default=0)
        known = event_steps | journal_steps
        self.known_steps = known
        for a, b in _ranges([s for s in range(1, top + 1) if s not in known]):
            c4.fail("step_gap", f"{_span(a, b)} missing: no trained event and no journal task trained in it")
        for s in sorted(event_steps):
            if s > self.journal_step:
                c4.fail(
                    "step_not_in_journal", f"trained event for step {s}, beyond the journal's step {self.journal_step}"
                )
        only_journal = sorted(journal_steps - event_steps)
        if only_journal:
            spans = ", ".join(_span(a, b) for a, b in _ranges(only_journal)[:5])
            self.warnings.append(
                f"journal has tasks trained in {spans} with no trained event (events lost in a crash?)"
            )
        c4.stats["trained events"] = self.trained_events
        c4.stats["last event step"] = self.last_step
        c4.stats["journal step"] = self.journal_step

    def check_versions(self) -> None:
        c4 = self.c[4]
        acked = self.j.versions
        for key, v in sorted(self.served.items()):
            svc = key.split("[", 1)[0]
            if svc in acked:
                if v > acked[svc]:
                    c4.fail(
                        "served_unacknowledged",
                        f"{key} served version {v} but the journal acknowledged only version {acked[svc]}",
                    )
            else:
                c4.notes.append(f"{key}: served versions not cross-checked (the journal tracks no version for it)")
        c4.stats["max version served"] = dict(sorted(self.served.items())) or "none"
        c4.stats["journal versions"] = dict(sorted(acked.items())) or "none"
        if self.ckpt_version:
            c4.stats["last checkpoint"] = {
                k: f"v{self.ckpt_version[k]}@step{self.ckpt_step[k]}" for k in sorted(self.ckpt_version)
            }

    def check_replay(self) -> None:
        """Invariant 4's mechanism: a restarted service replays the batches after its checkpoint,
        so the journal must still hold every one of them."""
        c4 = self.c[4]
        ckpts = self.j.checkpoint_steps
        if not ckpts:
            return
        oldest = min(ckpts.values())
        # A step that never happened (a step_gap, reported already) has no batch to replay.
        needed = [s for s in range(oldest + 1, self.journal_step + 1) if s in self.known_steps]
        if not needed:
            c4.notes.append(f"replay: every trainable service checkpointed at or after step {self.journal_step}")
            return
        # One batch at a time: these can be large, and only their presence matters.
        missing = [s for s in needed if self.j.get_batch(s) is None]
        if len(missing) == len(needed):
            self.warnings.append(
                f"journal stores no training batch for steps {oldest + 1}..{self.journal_step} (after the oldest"
                f" checkpoint, {ckpts}); a restarted service could not be replayed. Not counted as a"
                " violation: the writer may not store batches at all"
            )
            return
        if self.j.get_batch(0) is not None:
            # mark_trained refuses step 0, so a batch under key 0 was stored by its pre-step number.
            c4.notes.append(
                "a training batch is stored under step 0, which no training step has: batches look keyed"
                " one step early (put_batch(journal.step) instead of put_batch(journal.step + 1))"
            )
        for a, b in _ranges(missing):
            c4.fail(
                "replay_gap", f"journal lacks the training batch of {_span(a, b)}, needed after checkpoints {ckpts}"
            )

    def finish_resources(self, log_behind_journal: bool) -> None:
        c5 = self.c[5]
        if self.in_flight_excess_count:
            if log_behind_journal:
                # Lost trained/dead events keep tasks "in flight" in the replay; do not blame admission.
                self.warnings.append(
                    f"in flight replayed from events exceeded the ceiling {self.lim.in_flight_ceiling}"
                    f" {self.in_flight_excess_count} times, but the log misses terminal events the journal has,"
                    " so the replay overcounts; not counted as a violation"
                )
            else:
                for msg in self.in_flight_excess:
                    c5.fail("in_flight_over_limit", msg)
                c5.violations["in_flight_over_limit"] += self.in_flight_excess_count - len(self.in_flight_excess)
        c5.stats["resources events"] = self.resources_events
        c5.stats["max queue depth"] = {
            s: f"{d} (limit {self.lim.queue_limit(s) if self.lim.queue_limit(s) is not None else 'unbounded'})"
            for s, d in sorted(self.queue_max.items())
        } or "none"
        c5.stats["max in flight"] = f"{self.in_flight_max} (ceiling {self.lim.in_flight_ceiling})"
        c5.stats["max rss bytes"] = dict(sorted(self.rss_max.items())) or "none"
        c5.stats["max disk bytes"] = self.disk_max if self.disk_max is not None else "none"
        if self.disk_free_min is not None:
            c5.stats["min disk free bytes"] = self.disk_free_min
        if self.lim.rss_bytes is None:
            c5.notes.append("no rss limit given (limits['rss_bytes']); maxima reported only")
        if self.lim.disk_bytes is None:
            c5.notes.append("no disk limit given (limits['disk_bytes']); maxima reported only")
        if not self.resources_events:
            c5.notes.append("no resources events in the log; queue, rss and disk not checked")


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


def _audit(run_dir: Path, lim: Limits, j: Journal, warnings: list[str], finished: bool | None) -> AuditReport:
    a = _Auditor(run_dir, lim, j, warnings)
    events_path = run_dir / "events.jsonl"
    if not events_path.exists():
        warnings.append(f"{events_path} not found: only the journal was checked")
    log = _LogReader(events_path)
    a.read_events(log)
    n_events = sum(a.kinds.values())
    torn, unreadable = log.torn, log.unreadable
    if unreadable:
        # The writer emits whole lines; an unreadable one in the middle means a second writer or
        # corruption, and the history the checks replay is incomplete.
        warnings.append(f"{unreadable} unreadable line(s) in the middle of {events_path.name} were skipped")
    if a.unknown_kinds:
        warnings.append(f"events of unknown kinds ignored: {dict(a.unknown_kinds)}")

    if finished is None:
        if a.run_finished:
            finished, why = True, f"a {RUN_FINISHED_KIND} event"
        elif a.journal_step >= lim.max_steps:
            finished, why = True, f"journal step {a.journal_step} >= run.max_steps {lim.max_steps}"
        else:
            finished = False
            why = f"journal step {a.journal_step} < run.max_steps {lim.max_steps}, no {RUN_FINISHED_KIND} event"
        why = "auto-detected: " + why
    else:
        why = "as told by the caller"

    n_event_ids, n_trained_ids = len(a.event_ids), len(a.trained)
    scan = a.read_journal(finished)
    tasks_by_state = {s.value: scan.states.get(s.value, 0) for s in TaskState}
    counters = j.counts()
    if counters != tasks_by_state and finished:
        # Only meaningful at rest: the chunked scan is not one snapshot while a controller writes.
        warnings.append(f"journal state counters {counters} disagree with its records {tasks_by_state}")
    n_in_flight = sum(tasks_by_state[s] for s in ("admitted", "generated", "scored"))
    c1 = a.c[1]
    c1.stats["journal tasks"] = sum(tasks_by_state.values())
    c1.stats["task ids in events"] = n_event_ids
    c1.stats["in flight"] = n_in_flight
    if n_in_flight and not finished:
        c1.notes.append(f"{n_in_flight} task(s) in flight (allowed: the run is still going)")
    if scan.missing_trained_event:
        warnings.append(f"{scan.missing_trained_event} trained journal task(s) have no trained event")
    if scan.missing_dead_event:
        warnings.append(f"{scan.missing_dead_event} dead journal task(s) have no dead event")
    a.c[2].stats["trained tasks (journal)"] = tasks_by_state["trained"]
    a.c[2].stats["tasks in trained events"] = n_trained_ids

    a.check_steps(scan.trained_steps)
    a.check_versions()
    a.check_replay()
    a.finish_resources(log_behind_journal=bool(scan.missing_trained_event or scan.missing_dead_event))

    return AuditReport(
        run_dir=run_dir,
        finished=finished,
        finished_reason=why,
        limits=lim,
        steps={
            "journal": a.journal_step,
            "trained events": a.last_step,
            "metrics": _metrics_last_step(run_dir / "metrics.jsonl"),
            "run.max_steps": lim.max_steps,
        },
        tasks_by_state=tasks_by_state,
        dead_reasons=dict(scan.dead_reasons),
        in_flight=scan.in_flight_examples,
        event_log={
            "path": str(events_path),
            "exists": events_path.exists(),
            "events": n_events,
            "by_kind": dict(a.kinds),
            "torn_last_line": torn,
            "unreadable_lines": unreadable,
            "malformed": dict(a.malformed),
        },
        checks=[a.c[n] for n in sorted(a.c)],
        warnings=warnings,
    )


def audit_main(
    run_dir: Path,
    *,
    finished: bool | None = None,
    json_out: bool = False,
    limits: dict[str, Any] | None = None,
) -> int:
    """`rlfleet audit --run-dir DIR`: print the report (text, or JSON with `json_out`) to stdout
    and return the exit code: 0 all invariants hold, 1 a violation, 2 the run cannot be audited
    (the reason goes to stderr, or into the JSON as `error`)."""
    try:
        report = audit(Path(run_dir), finished=finished, limits=limits)
    except AuditError as err:
        if json_out:
            print(json.dumps({"run_dir": str(run_dir), "ok": False, "error": str(err)}, indent=2))
        print(f"rlfleet audit: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(report.to_dict(), indent=2) if json_out else report.render())
    return report.exit_code
