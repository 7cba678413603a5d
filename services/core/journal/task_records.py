"""Task records and their rules: the journal's errors, task states and the legal transitions
between them, what admission knows about a task (`TaskSpec`), the stored record (`TaskRecord`, as
compact JSON, never pickle), the staleness bound, and the LMDB key encodings. The journal
(`services.core.journal.journal`) applies them in transactions and re-exports the public names."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.core.journal.lmdb_store import StoreFull

_MAX_KEY_BYTES = 511  # LMDB's compiled-in maximum key size


class JournalError(RuntimeError):
    """An operation the journal refuses: an illegal transition, an unknown task, a broken invariant."""


class JournalFull(JournalError, StoreFull):
    """The journal cannot grow: its map reached `max_map_size` or its filesystem is full.

    Nothing of the failed transaction was written; the last committed state is intact and the
    journal accepts writes again once space returns."""


class ExactlyOnceError(JournalError):
    """A task would count in a second training step (invariant 2)."""


class StalenessError(JournalError):
    """A task would be trained on a policy too far ahead of the one that generated it (invariant 3)."""


class TaskState(StrEnum):
    ADMITTED = "admitted"
    GENERATED = "generated"
    SCORED = "scored"
    TRAINED = "trained"
    DEAD = "dead"
    # Scored, then left out of training on purpose (dynamic sampling), with a reason: not a failure.
    DROPPED = "dropped"


TERMINAL_STATES: frozenset[TaskState] = frozenset({TaskState.TRAINED, TaskState.DEAD, TaskState.DROPPED})
# Forward edges only. Re-entering the current state is a no-op handled separately (redelivery),
# except `trained`, which `mark_trained` refuses to repeat (exactly-once).
NEXT: dict[TaskState, frozenset[TaskState]] = {
    TaskState.ADMITTED: frozenset({TaskState.GENERATED, TaskState.DEAD}),
    TaskState.GENERATED: frozenset({TaskState.SCORED, TaskState.DEAD}),
    # Only a scored task can be dropped: the filter judges a group once all its scores are in.
    TaskState.SCORED: frozenset({TaskState.TRAINED, TaskState.DEAD, TaskState.DROPPED}),
    TaskState.TRAINED: frozenset(),
    TaskState.DEAD: frozenset(),
    TaskState.DROPPED: frozenset(),
}


@dataclass(frozen=True)
class TaskSpec:
    """What the controller knows about a task when it admits it."""

    task_id: str
    dataset_index: int
    sample_index: int
    group_id: int


@dataclass
class TaskRecord:
    task_id: str
    state: TaskState
    dataset_index: int
    sample_index: int
    group_id: int
    admitted_step: int
    batch_id: str | None = None
    generated_version: int | None = None
    trained_step: int | None = None
    trained_version: int | None = None
    stages_done: frozenset[str] = frozenset()
    reason: str | None = None
    dropped_step: int | None = None  # the step a dropped task was judged for
    # Wall-clock time each state was entered, keyed by state name (latency per stage, audit).
    timestamps: dict[str, float] = field(default_factory=dict)

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_bytes(self) -> bytes:
        d: dict[str, Any] = {
            "task_id": self.task_id,
            "state": self.state.value,
            "dataset_index": self.dataset_index,
            "sample_index": self.sample_index,
            "group_id": self.group_id,
            "admitted_step": self.admitted_step,
        }
        # Unset fields are omitted: records stay small and the schema can grow without migrations.
        for name in ("batch_id", "generated_version", "trained_step", "trained_version", "reason", "dropped_step"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.stages_done:
            d["stages_done"] = sorted(self.stages_done)
        d["timestamps"] = self.timestamps
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TaskRecord:
        d = json.loads(raw)
        return cls(
            task_id=d["task_id"],
            state=TaskState(d["state"]),
            dataset_index=d["dataset_index"],
            sample_index=d["sample_index"],
            group_id=d["group_id"],
            admitted_step=d["admitted_step"],
            batch_id=d.get("batch_id"),
            generated_version=d.get("generated_version"),
            trained_step=d.get("trained_step"),
            trained_version=d.get("trained_version"),
            stages_done=frozenset(d.get("stages_done", ())),
            reason=d.get("reason"),
            dropped_step=d.get("dropped_step"),
            timestamps=dict(d.get("timestamps", {})),
        )


def check_staleness(task_id: str, generated_version: int, trained_version: int, max_staleness: int) -> None:
    """Invariant 3: `trained_version - generated_version <= max_staleness`.

    `trained_version` is the policy version the training step updates (the version before the
    update), so `max_staleness: 0` means strictly on-policy. A task generated by a version newer
    than the one being trained is a bookkeeping bug and is refused too."""
    lag = trained_version - generated_version
    if lag < 0:
        raise StalenessError(
            f"task {task_id!r}: generated at version {generated_version}, newer than the training"
            f" version {trained_version}"
        )
    if lag > max_staleness:
        raise StalenessError(
            f"task {task_id!r}: generated at version {generated_version}, trained at version"
            f" {trained_version}: staleness {lag} exceeds max_staleness {max_staleness}"
        )


# -- encoding helpers --------------------------------------------------------------------------


def task_key(task_id: str) -> bytes:
    if not isinstance(task_id, str) or not task_id:
        raise JournalError(f"task id must be a non-empty string, got {task_id!r}")
    key = task_id.encode()
    if len(key) > _MAX_KEY_BYTES:
        raise JournalError(
            f"task id {task_id[:40]!r}... is {len(key)} bytes; LMDB keys are at most {_MAX_KEY_BYTES}"
        )
    return key


def step_key(step: int) -> bytes:
    if step < 0:
        raise JournalError(f"step must be >= 0, got {step}")
    return step.to_bytes(8, "big")


def result_key(key: str, stage: str) -> bytes:
    if "\x00" in key or "\x00" in stage or not key or not stage:
        raise JournalError(f"result key and stage must be non-empty and NUL-free, got {key!r}, {stage!r}")
    raw = key.encode() + b"\x00" + stage.encode()
    if len(raw) > _MAX_KEY_BYTES:
        raise JournalError(
            f"result key {key[:40]!r}.../{stage} exceeds LMDB's {_MAX_KEY_BYTES}-byte key limit"
        )
    return raw


def unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))
