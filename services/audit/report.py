"""The audit's verdict as a whole (`AuditReport`): what the run holds, each invariant's result, and
the text a person reads or the JSON a program reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.audit.limits import Limits
from services.audit.results import CheckResult

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_ERROR = 2


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
