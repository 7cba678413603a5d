"""The controller's task journal: one LMDB environment, the run's source of truth.

Redis is transport; this journal is truth. It holds every task's state
(`admitted → generated → scored → trained`, or `dead(reason)`), the dataset cursor, the step
counter, each trainable service's policy version and checkpoint step, the training batches a
restarted actor or critic must replay, and put-if-absent stage results.

Layout (named sub-databases of one environment, so one write transaction spans all of them):

    tasks    task_id               -> TaskRecord as compact JSON (never pickle)
    live     task_id               -> b""  index of non-terminal tasks (crash reconciliation)
    meta     b"cursor", b"step", b"fingerprint", b"schema",
             b"version:<service>", b"ckpt:<service>", b"count:<state>"
    batches  step (8-byte big-endian, so byte order == numeric order) -> opaque TrainBatch bytes
    results  <id> NUL <stage>      -> opaque bytes, written put-if-absent

Every public mutation is ONE write transaction: a crash (kill -9, power loss) leaves either all
of it or none of it, never half a step or an admitted batch without its cursor advance.

Durability tradeoff: `sync=True, metasync=True` (the default) fsyncs data and meta pages on every
commit, so a commit that returned survives power loss; it costs one or two fsyncs per call
(~ms on SSD). Journal writes happen a few times per training step, so this is cheap. With
`sync=False` a process crash still loses nothing (the OS page cache survives kill -9) but power
loss or a kernel crash may roll back the last commits; `metasync=False` keeps data consistent
(LMDB falls back to the previous meta page) but may lose the last commit on power loss.

Threading: the controller calls these methods through `asyncio.to_thread`, so calls may come from
several threads. One lock serialises them: LMDB allows one writer anyway, and growing the map
(`set_mapsize`) requires that no transaction of this process is open.

Only one `Journal` per environment per process: LMDB's POSIX locks are per process and closing a
second handle would silently drop the first one's locks. `open` enforces it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from services.core.lmdb_store import LmdbStore

SCHEMA_VERSION = 1
DEFAULT_MAP_SIZE = 64 << 20  # 64 MiB; with writemap off this is address space, not disk
DEFAULT_MAX_MAP_SIZE = 64 << 30  # 64 GiB
# LMDB reports a short write (disk filled up mid-write) as EIO, not ENOSPC. Below this many free
# bytes we read such an EIO as "disk full"; above it, it is a real I/O error and we say so.
_MAX_KEY_BYTES = 511  # LMDB's compiled-in maximum key size
_ITER_CHUNK = 1024

T = TypeVar("T")


class JournalError(RuntimeError):
    """An operation the journal refuses: an illegal transition, an unknown task, a broken invariant."""


class JournalFull(JournalError):
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


TERMINAL_STATES: frozenset[TaskState] = frozenset({TaskState.TRAINED, TaskState.DEAD})
# Forward edges only. Re-entering the current state is a no-op handled separately (redelivery),
# except `trained`, which `mark_trained` refuses to repeat (exactly-once).
_NEXT: dict[TaskState, frozenset[TaskState]] = {
    TaskState.ADMITTED: frozenset({TaskState.GENERATED, TaskState.DEAD}),
    TaskState.GENERATED: frozenset({TaskState.SCORED, TaskState.DEAD}),
    TaskState.SCORED: frozenset({TaskState.TRAINED, TaskState.DEAD}),
    TaskState.TRAINED: frozenset(),
    TaskState.DEAD: frozenset(),
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
        for name in ("batch_id", "generated_version", "trained_step", "trained_version", "reason"):
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


def _task_key(task_id: str) -> bytes:
    if not isinstance(task_id, str) or not task_id:
        raise JournalError(f"task id must be a non-empty string, got {task_id!r}")
    key = task_id.encode()
    if len(key) > _MAX_KEY_BYTES:
        raise JournalError(
            f"task id {task_id[:40]!r}... is {len(key)} bytes; LMDB keys are at most {_MAX_KEY_BYTES}"
        )
    return key


def _step_key(step: int) -> bytes:
    if step < 0:
        raise JournalError(f"step must be >= 0, got {step}")
    return step.to_bytes(8, "big")


def _result_key(key: str, stage: str) -> bytes:
    if "\x00" in key or "\x00" in stage or not key or not stage:
        raise JournalError(f"result key and stage must be non-empty and NUL-free, got {key!r}, {stage!r}")
    raw = key.encode() + b"\x00" + stage.encode()
    if len(raw) > _MAX_KEY_BYTES:
        raise JournalError(
            f"result key {key[:40]!r}.../{stage} exceeds LMDB's {_MAX_KEY_BYTES}-byte key limit"
        )
    return raw


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


_DB_NAMES = (b"tasks", b"live", b"meta", b"batches", b"results")


class Journal(LmdbStore):
    """The task journal. Create with `Journal.open(path)`; every method is synchronous."""

    kind = "journal"
    error = JournalError
    full_error = JournalFull
    db_names = _DB_NAMES
    schema_version = SCHEMA_VERSION
    full_advice = ("Nothing of this transaction was written and the last committed state is intact;"
                   " free disk space (or raise max_map_size) and retry.")

    def __init__(
        self,
        path: Path,
        *,
        map_size: int,
        max_map_size: int,
        sync: bool,
        metasync: bool,
        stages: Sequence[str],
        trainable: Sequence[str],
        readonly: bool,
    ) -> None:
        super().__init__(path, map_size=map_size, max_map_size=max_map_size, sync=sync, metasync=metasync,
                         readonly=readonly)
        self._stages = frozenset(stages)
        self._trainable = tuple(trainable)

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int = DEFAULT_MAX_MAP_SIZE,
        sync: bool = True,
        metasync: bool = True,
        stages: Sequence[str] = ("reward",),
        trainable: Sequence[str] = ("actor",),
        readonly: bool = False,
    ) -> Journal:
        """Open (creating unless `readonly`) the journal in directory `path`.

        `stages`: the scoring stages a task needs before it is `scored` (`RunConfig.stages()`).
        `trainable`: the services whose training batches are kept until each has checkpointed
        past them (`actor`, plus `critic` for PPO). Stale reader slots left by killed processes
        are cleared on open."""
        if not stages:
            raise ValueError("a journal needs at least one scoring stage")
        return cls._open_store(path, map_size, max_map_size, readonly, lambda p, size, max_size: cls(
            p, map_size=size, max_map_size=max_size, sync=sync, metasync=metasync, stages=stages,
            trainable=trainable, readonly=readonly))

    @property
    def stages(self) -> frozenset[str]:
        return self._stages

    @property
    def trainable(self) -> tuple[str, ...]:
        return self._trainable

    # -- record helpers (inside a transaction) -----------------------------------------------

    def _load(self, txn: Any, task_id: str) -> TaskRecord:
        raw = txn.get(_task_key(task_id), db=self._dbs[b"tasks"])
        if raw is None:
            raise JournalError(f"unknown task {task_id!r}")
        return TaskRecord.from_bytes(raw)

    def _store(self, txn: Any, rec: TaskRecord) -> None:
        txn.put(_task_key(rec.task_id), rec.to_bytes(), db=self._dbs[b"tasks"])

    def _get_int(self, txn: Any, key: bytes, default: int = 0) -> int:
        raw = txn.get(key, db=self._dbs[b"meta"])
        return default if raw is None else int(raw)

    def _put_int(self, txn: Any, key: bytes, value: int) -> None:
        txn.put(key, str(value).encode(), db=self._dbs[b"meta"])

    def _bump(self, txn: Any, state: TaskState, delta: int) -> None:
        key = b"count:" + state.value.encode()
        self._put_int(txn, key, self._get_int(txn, key) + delta)

    def _move(self, txn: Any, rec: TaskRecord, target: TaskState) -> bool:
        """Move `rec` to `target` and store it; False when it already was there (redelivery)."""
        if rec.state is target:
            return False
        if target not in _NEXT[rec.state]:
            raise JournalError(
                f"task {rec.task_id!r}: illegal transition {rec.state.value} -> {target.value}"
            )
        self._bump(txn, rec.state, -1)
        self._bump(txn, target, +1)
        rec.state = target
        rec.timestamps[target.value] = time.time()
        self._store(txn, rec)
        if target in TERMINAL_STATES:
            txn.delete(_task_key(rec.task_id), db=self._dbs[b"live"])
        return True

    # -- task transitions --------------------------------------------------------------------

    def admit(self, tasks: Sequence[TaskSpec], cursor: int) -> int:
        """Write `tasks` as `admitted` and set the dataset cursor to `cursor`, in one transaction.

        Returns how many tasks were new. Re-admitting an identical admitted task is a no-op;
        re-admitting one that moved on, or with a different spec, raises. The cursor never goes
        backwards."""
        for t in tasks:
            _task_key(t.task_id)

        def fn(txn: Any) -> int:
            current = self._get_int(txn, b"cursor")
            if cursor < current:
                raise JournalError(f"dataset cursor would go backwards: {current} -> {cursor}")
            step = self._get_int(txn, b"step")
            now = time.time()
            new = 0
            for spec in tasks:
                key = _task_key(spec.task_id)
                raw = txn.get(key, db=self._dbs[b"tasks"])
                if raw is not None:
                    old = TaskRecord.from_bytes(raw)
                    if old.state is not TaskState.ADMITTED:
                        raise JournalError(
                            f"task {spec.task_id!r}: illegal transition {old.state.value} -> admitted"
                        )
                    if (old.dataset_index, old.sample_index, old.group_id) != (
                        spec.dataset_index,
                        spec.sample_index,
                        spec.group_id,
                    ):
                        raise JournalError(f"task {spec.task_id!r} is already admitted with a different spec")
                    continue
                rec = TaskRecord(
                    task_id=spec.task_id,
                    state=TaskState.ADMITTED,
                    dataset_index=spec.dataset_index,
                    sample_index=spec.sample_index,
                    group_id=spec.group_id,
                    admitted_step=step,
                    timestamps={TaskState.ADMITTED.value: now},
                )
                txn.put(key, rec.to_bytes(), db=self._dbs[b"tasks"])
                txn.put(key, b"", db=self._dbs[b"live"])
                new += 1
            self._bump(txn, TaskState.ADMITTED, new)
            self._put_int(txn, b"cursor", cursor)
            return new

        return self._write(fn)

    def mark_generated(self, task_ids: Iterable[str], version: int, batch_id: str) -> list[str]:
        """`admitted -> generated` under policy `version`, in rollout batch `batch_id`.

        Returns the tasks that moved; already-generated ones keep their first version (the first
        generation is the one whose results are kept put-if-absent)."""
        if version < 0:
            raise JournalError(f"policy version must be >= 0, got {version}")
        ids = _unique(task_ids)

        def fn(txn: Any) -> list[str]:
            moved = []
            for tid in ids:
                rec = self._load(txn, tid)
                if rec.state is TaskState.ADMITTED:
                    rec.generated_version = version
                    rec.batch_id = batch_id
                if self._move(txn, rec, TaskState.GENERATED):
                    moved.append(tid)
            return moved

        return self._write(fn)

    def mark_stage_done(self, task_ids: Iterable[str], stage: str) -> list[str]:
        """Record that scoring `stage` finished for `task_ids`; returns the tasks that became
        `scored` in this call because every stage of `self.stages` is now done.

        A result for a task that is already scored, trained or dead is a late redelivery and is
        ignored; one for a task not yet generated raises (the journal would not know its version)."""
        if stage not in self._stages:
            raise JournalError(
                f"unknown scoring stage {stage!r}; this run's stages are {sorted(self._stages)}"
            )
        ids = _unique(task_ids)

        def fn(txn: Any) -> list[str]:
            scored = []
            for tid in ids:
                rec = self._load(txn, tid)
                if rec.state is TaskState.ADMITTED:
                    raise JournalError(
                        f"task {tid!r}: stage {stage!r} finished before the task was generated"
                    )
                if rec.state is not TaskState.GENERATED or stage in rec.stages_done:
                    continue
                rec.stages_done = rec.stages_done | {stage}
                if rec.stages_done >= self._stages:
                    self._move(txn, rec, TaskState.SCORED)
                    scored.append(tid)
                else:
                    self._store(txn, rec)
            return scored

        return self._write(fn)

    def mark_scored(self, task_ids: Iterable[str]) -> list[str]:
        """`generated -> scored` regardless of stages; returns the tasks that moved."""
        ids = _unique(task_ids)

        def fn(txn: Any) -> list[str]:
            return [tid for tid in ids if self._move(txn, self._load(txn, tid), TaskState.SCORED)]

        return self._write(fn)

    def mark_trained(
        self,
        task_ids: Iterable[str],
        step: int,
        version: int,
        max_staleness: int,
        *,
        batch: bytes | None = None,
    ) -> None:
        """Commit training step `step`: `scored -> trained` for every task, the step counter set
        to `step`, and (when given) the step's TrainBatch bytes stored for replay, all in one
        transaction.

        `version` is the policy version the step trains (before its update). Refuses, writing
        nothing, when a task already counts in a training step, appears twice, is not `scored`,
        or violates the staleness bound (`check_staleness`)."""
        if step < 1:
            raise JournalError(f"training steps count from 1, got {step}")
        if max_staleness < 0:
            raise JournalError(f"max_staleness must be >= 0, got {max_staleness}")
        ids = list(task_ids)
        if len(set(ids)) != len(ids):
            dup = next(t for t in ids if ids.count(t) > 1)
            raise ExactlyOnceError(f"task {dup!r} appears more than once in training step {step}")

        def fn(txn: Any) -> None:
            current = self._get_int(txn, b"step")
            if step < current:
                raise JournalError(f"training step {step} is behind the journal's step {current}")
            for tid in ids:
                rec = self._load(txn, tid)
                if rec.state is TaskState.TRAINED:
                    raise ExactlyOnceError(
                        f"task {tid!r} already counts in training step {rec.trained_step} (version"
                        f" {rec.trained_version}); refusing to count it again in step {step}"
                    )
                if rec.state is not TaskState.SCORED:
                    raise JournalError(f"task {tid!r}: illegal transition {rec.state.value} -> trained")
                assert rec.generated_version is not None  # set on admitted -> generated
                check_staleness(tid, rec.generated_version, version, max_staleness)
                rec.trained_step = step
                rec.trained_version = version
                self._move(txn, rec, TaskState.TRAINED)
            if batch is not None:
                txn.put(_step_key(step), batch, db=self._dbs[b"batches"])
            self._put_int(txn, b"step", step)

        self._write(fn)

    def mark_dead(self, task_ids: Iterable[str], reason: str) -> list[str]:
        """Any non-terminal state -> `dead(reason)`; returns the tasks that moved. An already dead
        task keeps its first reason; a trained task cannot die (it already counted)."""
        if not reason:
            raise JournalError("a dead task needs a reason")
        ids = _unique(task_ids)

        def fn(txn: Any) -> list[str]:
            moved = []
            for tid in ids:
                rec = self._load(txn, tid)
                if rec.state is not TaskState.DEAD:
                    rec.reason = reason
                if self._move(txn, rec, TaskState.DEAD):
                    moved.append(tid)
            return moved

        return self._write(fn)

    # -- task queries ------------------------------------------------------------------------

    def get(self, task_id: str) -> TaskRecord | None:
        key = _task_key(task_id)

        def fn(txn: Any) -> TaskRecord | None:
            raw = txn.get(key, db=self._dbs[b"tasks"])
            return None if raw is None else TaskRecord.from_bytes(raw)

        return self._read(fn)

    def non_terminal(self) -> list[TaskRecord]:
        """Every task not yet trained or dead, in dataset order: what reconciliation after a crash
        must re-enqueue or wait for. Reads the `live` index, so it costs O(in flight), not O(run)."""

        def fn(txn: Any) -> list[TaskRecord]:
            tasks = self._dbs[b"tasks"]
            out = []
            for key, _ in txn.cursor(db=self._dbs[b"live"]):
                raw = txn.get(key, db=tasks)
                if raw is None:  # cannot happen: live and tasks change in the same transaction
                    raise JournalError(f"journal {self._path}: live index names missing task {key!r}")
                out.append(TaskRecord.from_bytes(raw))
            return out

        recs = self._read(fn)
        recs.sort(key=lambda r: (r.dataset_index, r.sample_index, r.task_id))
        return recs

    def counts(self) -> dict[str, int]:
        """Tasks per state, from counters kept in the same transactions as the records."""

        def fn(txn: Any) -> dict[str, int]:
            return {s.value: self._get_int(txn, b"count:" + s.value.encode()) for s in TaskState}

        return self._read(fn)

    def in_flight(self) -> int:
        """Admitted but not yet trained or dead: what admission control bounds."""
        c = self.counts()
        return c["admitted"] + c["generated"] + c["scored"]

    def iter_tasks(self) -> Iterator[TaskRecord]:
        """Every task in key order. Reads in chunks with short transactions so a slow consumer
        neither pins old pages (file growth) nor blocks map growth."""
        after: bytes | None = None
        while True:
            page = self._read(functools.partial(self._page, after=after))
            if not page:
                return
            yield from (TaskRecord.from_bytes(v) for _, v in page)
            after = page[-1][0]

    def _page(self, txn: Any, after: bytes | None) -> list[tuple[bytes, bytes]]:
        cur = txn.cursor(db=self._dbs[b"tasks"])
        # key + NUL is the immediate successor of key in byte order: strictly after `after`.
        ok = cur.first() if after is None else cur.set_range(after + b"\x00")
        out: list[tuple[bytes, bytes]] = []
        while ok and len(out) < _ITER_CHUNK:
            out.append((bytes(cur.key()), bytes(cur.value())))
            ok = cur.next()
        return out

    # -- meta: cursor, step, versions, fingerprint -------------------------------------------

    @property
    def cursor(self) -> int:
        return self._read(lambda txn: self._get_int(txn, b"cursor"))

    @property
    def step(self) -> int:
        """The last committed training step (0 before the first)."""
        return self._read(lambda txn: self._get_int(txn, b"step"))

    def set_step(self, step: int) -> None:
        def fn(txn: Any) -> None:
            current = self._get_int(txn, b"step")
            if step < current:
                raise JournalError(f"step would go backwards: {current} -> {step}")
            self._put_int(txn, b"step", step)

        self._write(fn)

    @property
    def versions(self) -> dict[str, int]:
        """Acknowledged policy version per trainable service."""

        def fn(txn: Any) -> dict[str, int]:
            return {
                bytes(k)[len(b"version:") :].decode(): int(v)
                for k, v in self._prefixed(txn, self._dbs[b"meta"], b"version:")
            }

        return self._read(fn)

    def set_version(self, service: str, version: int) -> None:
        """Record that `service` acknowledged `version`. Versions never go backwards (invariant 4):
        a lower one means a service restarted from an older checkpoint and was not replayed."""
        key = b"version:" + service.encode()

        def fn(txn: Any) -> None:
            current = self._get_int(txn, key, default=-1)
            if version < current:
                raise JournalError(f"{service} version would go backwards: {current} -> {version}")
            self._put_int(txn, key, version)

        self._write(fn)

    @property
    def fingerprint(self) -> str | None:
        raw = self._read(lambda txn: txn.get(b"fingerprint", db=self._dbs[b"meta"]))
        return None if raw is None else bytes(raw).decode()

    def bind_fingerprint(self, fingerprint: str) -> None:
        """Store the run fingerprint on first call; afterwards refuse a different one, so a
        journal is never resumed under an incompatible config."""

        def fn(txn: Any) -> None:
            raw = txn.get(b"fingerprint", db=self._dbs[b"meta"])
            if raw is None:
                txn.put(b"fingerprint", fingerprint.encode(), db=self._dbs[b"meta"])
            elif bytes(raw).decode() != fingerprint:
                raise JournalError(
                    f"journal {self._path} belongs to run fingerprint {bytes(raw).decode()!r},"
                    f" not {fingerprint!r}"
                )

        self._write(fn)

    @staticmethod
    def _prefixed(txn: Any, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cur = txn.cursor(db=db)
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not bytes(k).startswith(prefix):
                return
            yield bytes(k), bytes(v)

    # -- training batches (replay after an actor/critic restart) -----------------------------

    def put_batch(self, step: int, data: bytes) -> None:
        """Store (or replace) the TrainBatch bytes of `step`. `mark_trained(batch=...)` does this
        in the same transaction as the step commit; use this only for out-of-band writes."""
        key = _step_key(step)
        self._write(lambda txn: txn.put(key, data, db=self._dbs[b"batches"]))

    def get_batch(self, step: int) -> bytes | None:
        key = _step_key(step)
        raw = self._read(lambda txn: txn.get(key, db=self._dbs[b"batches"]))
        return None if raw is None else bytes(raw)

    def batches_after(self, service_checkpoint_step: int) -> list[tuple[int, bytes]]:
        """Batches of steps > `service_checkpoint_step`, oldest first: what a service restarted
        from that checkpoint must be replayed to catch up."""
        start = _step_key(max(service_checkpoint_step + 1, 0))

        def fn(txn: Any) -> list[tuple[int, bytes]]:
            cur = txn.cursor(db=self._dbs[b"batches"])
            if not cur.set_range(start):
                return []
            return [(int.from_bytes(k, "big"), bytes(v)) for k, v in cur]

        return self._read(fn)

    @property
    def checkpoint_steps(self) -> dict[str, int]:
        """Last acknowledged checkpoint step per trainable service (0: none yet)."""

        def fn(txn: Any) -> dict[str, int]:
            return {s: self._get_int(txn, b"ckpt:" + s.encode()) for s in self._trainable}

        return self._read(fn)

    def prune_batches(self, service: str, up_to_step: int) -> int:
        """`service` acknowledged a checkpoint covering steps <= `up_to_step`. Record it and
        delete the batches no trainable service can need any more (those at or below every
        service's checkpoint step). Returns how many batches were deleted."""
        if service not in self._trainable:
            raise JournalError(
                f"{service!r} is not a trainable service of this run ({list(self._trainable)})"
            )
        ckpt_key = b"ckpt:" + service.encode()

        def fn(txn: Any) -> int:
            # Monotonic: a late acknowledgement of an older checkpoint never un-covers steps.
            self._put_int(txn, ckpt_key, max(self._get_int(txn, ckpt_key), up_to_step))
            keep_after = min(self._get_int(txn, b"ckpt:" + s.encode()) for s in self._trainable)
            db = self._dbs[b"batches"]
            doomed = []
            for k in txn.cursor(db=db).iternext(keys=True, values=False):
                if int.from_bytes(k, "big") > keep_after:
                    break
                doomed.append(bytes(k))
            for k in doomed:
                txn.delete(k, db=db)
            return len(doomed)

        return self._write(fn)

    # -- stage results (put-if-absent, so a redelivery never counts twice) -------------------

    def put_result_if_absent(self, key: str, stage: str, data: bytes) -> bool:
        """Store `data` for (`key`, `stage`) unless a result is already there; True when written."""
        rk = _result_key(key, stage)
        return bool(self._write(lambda txn: txn.put(rk, data, overwrite=False, db=self._dbs[b"results"])))

    def get_result(self, key: str, stage: str) -> bytes | None:
        rk = _result_key(key, stage)
        raw = self._read(lambda txn: txn.get(rk, db=self._dbs[b"results"]))
        return None if raw is None else bytes(raw)

    def delete_results(self, keys: Iterable[str]) -> int:
        """Drop every stage's result for `keys` (after they are trained), keeping disk bounded."""
        prefixes = [_result_key(k, "x")[:-1] for k in _unique(keys)]

        def fn(txn: Any) -> int:
            db = self._dbs[b"results"]
            doomed = [k for p in prefixes for k, _ in self._prefixed(txn, db, p)]
            for k in doomed:
                txn.delete(k, db=db)
            return len(doomed)

        return self._write(fn)

    # -- health: readers, disk ---------------------------------------------------------------

    def has_space(self, min_free_bytes: int) -> bool:
        """False when fewer than `min_free_bytes` remain: stop admission and report not-ready
        before the journal ever sees ENOSPC."""
        return self.disk_free_bytes() >= min_free_bytes

    def usage(self) -> dict[str, int]:
        """Map size, bytes in use, data file size and free disk bytes (for `resources` events)."""
        with self._lock:
            env = self._require_env()
            info, stat = env.info(), env.stat()
        data = self._path / "data.mdb"
        return {
            "map_size": int(info["map_size"]),
            "used_bytes": (int(info["last_pgno"]) + 1) * int(stat["psize"]),
            "file_bytes": data.stat().st_size if data.exists() else 0,
            "disk_free_bytes": self.disk_free_bytes(),
        }
