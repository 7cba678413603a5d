"""One verdict per invariant (`CheckResult`), the set of five the checks write into (`Checks`), and
the small value tests every check shares."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from services.core.observability.events import Event

MAX_EXAMPLES = 10

INVARIANT_NAMES: dict[int, str] = {
    1: "no loss",
    2: "exactly-once effect",
    3: "bounded staleness",
    4: "monotonic versions",
    5: "bounded resources",
}

CHECKED: dict[int, str] = {
    1: "every journal task ends trained, dead(reason) or dropped(reason) (in flight allowed while running);"
    " every task id in any event has a journal record; dead and dropped events have a reason and match the"
    " journal; a group dropped as all-equal had equal rewards in its reward record and was dropped whole, one"
    " dropped as surplus was too stale for the next step",
    2: "no task twice within or across trained events; event step == journal trained_step; every trained"
    " step holds samples_per_step tasks in whole groups",
    3: "0 <= trained_version - generated_version <= max_staleness in journal records and trained events;"
    " journal and events agree on both versions",
    4: "version_served per service never decreases nor drops below a reported checkpoint; checkpoint"
    " version/step never decrease; max served <= journal's acknowledged version; trained steps 1,2,3..."
    " without repeat or gap; trained policy version never decreases; replay batches kept after the"
    " oldest checkpoint",
    5: "queue depths, rss and disk within limits in every resources event; in-flight tasks replayed from"
    " events <= the admission window",
}

# A malformed event may hide the very thing its invariant is about, so it fails that invariant.
_INVARIANT_OF_KIND: dict[str, int] = {
    "admitted": 1,
    "generated": 1,
    "scored": 1,
    "dead": 1,
    "dropped": 1,
    "trained": 2,
    "checkpoint": 4,
    "version_served": 4,
    "resources": 5,
}


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


class Checks:
    """The five verdicts of one audit, plus the count of malformed events by kind."""

    def __init__(self) -> None:
        self.by_number = {n: CheckResult(n, INVARIANT_NAMES[n], CHECKED[n]) for n in INVARIANT_NAMES}
        self.malformed: Counter[str] = Counter()

    def __getitem__(self, number: int) -> CheckResult:
        return self.by_number[number]

    def ordered(self) -> list[CheckResult]:
        return [self.by_number[n] for n in sorted(self.by_number)]

    def malformed_event(self, ev: Event, why: str) -> None:
        self.malformed_in(ev.kind, _INVARIANT_OF_KIND[ev.kind], f"{ev.kind} event at ts {ev.ts}: {why}")

    def malformed_in(self, kind: str, number: int, message: str) -> None:
        """A malformed `kind` event that fails invariant `number` (not the kind's default one)."""
        self.malformed[kind] += 1
        self.by_number[number].fail("malformed_event", message)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN is not a number here


def task_ids(v: Any) -> list[str] | None:
    if isinstance(v, list) and all(isinstance(t, str) for t in v):
        return v
    return None


def ranges(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted ints collapsed into inclusive (first, last) runs."""
    out: list[tuple[int, int]] = []
    for s in sorted(steps):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def span(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}..{b}"
