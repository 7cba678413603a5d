"""`JournalDropped`: the journal's side of dynamic sampling. A scored task that dynamic sampling
leaves out of training ends `dropped(reason)` (terminal, never trained), counted per kind and per
step in the same transaction, so the bound on drops per step and the metrics survive a restart.
A mixin of `Journal`, using its transactions and record helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from services.core.journal.task_records import JournalError, TaskRecord, TaskState, unique

T = TypeVar("T")


class JournalDropped:
    _dbs: dict[bytes, Any]

    if TYPE_CHECKING:  # provided by LmdbStore, JournalReplay and Journal; declared for the type checker

        def _read(self, fn: Callable[[Any], T]) -> T: ...
        def _write(self, fn: Callable[[Any], T]) -> T: ...
        def _get_int(self, txn: Any, key: bytes, default: int = 0) -> int: ...
        def _put_int(self, txn: Any, key: bytes, value: int) -> None: ...
        def _load(self, txn: Any, task_id: str) -> TaskRecord: ...
        def _move(self, txn: Any, rec: TaskRecord, target: TaskState) -> bool: ...
        @staticmethod
        def _prefixed(txn: Any, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def mark_dropped(self, task_ids: Iterable[str], reason: str, *, step: int, kind: str) -> list[str]:
        """`scored -> dropped(reason)`: dynamic sampling leaves these tasks out of training on purpose.
        Counted per `kind` (the reason's prefix) under `step`, in the same transaction; returns the
        tasks that moved (an already dropped task keeps its first reason and is not counted again)."""
        if not reason or not kind or ":" in kind:
            raise JournalError(f"a dropped task needs a reason and a kind without ':', got {reason!r}, {kind!r}")
        ids = unique(task_ids)

        def fn(txn: Any) -> list[str]:
            moved = []
            for tid in ids:
                rec = self._load(txn, tid)
                if rec.state is TaskState.DROPPED:
                    continue
                rec.reason, rec.dropped_step = reason, step
                if self._move(txn, rec, TaskState.DROPPED):
                    moved.append(tid)
            key = f"dropped:{kind}:{step}".encode()
            self._put_int(txn, key, self._get_int(txn, key) + len(moved))
            return moved

        return self._write(fn)

    def dropped_for(self, step: int) -> dict[str, int]:
        """Tasks dynamic sampling dropped for `step`, per kind."""

        def fn(txn: Any) -> dict[str, int]:
            out = {}
            for k, v in self._prefixed(txn, self._dbs[b"meta"], b"dropped:"):
                kind, _, at = bytes(k)[len(b"dropped:"):].decode().rpartition(":")
                if at == str(step):
                    out[kind] = int(v)
            return out

        return self._read(fn)

    def prompts_for(self, step: int) -> int:
        """Prompts admitted while `step` was the next step to train."""
        return self._read(lambda txn: self._get_int(txn, b"prompts:%d" % step))
