"""The controller's task journal: one LMDB environment, the run's source of truth.

Redis is transport; this journal is truth. It holds every task's state
(`admitted → generated → scored → trained`, or `dead(reason)`, or `scored → dropped(reason)` by
dynamic sampling), the dataset cursor, the step
counter, each trainable service's policy version and checkpoint step, the training batches a
restarted actor or critic must replay, and put-if-absent stage results.

Layout (named sub-databases of one environment, so one write transaction spans all of them):

    tasks    task_id               -> TaskRecord as compact JSON (never pickle)
    live     task_id               -> b""  index of non-terminal tasks (crash reconciliation)
    meta     b"cursor", b"step", b"run_id", b"schema",
             b"version:<service>", b"ckpt:<service>", b"count:<state>",
             b"prompts:<step>" (prompts admitted while <step> was the next step),
             b"dropped:<kind>:<step>" (tasks dynamic sampling dropped, per kind, for <step>)
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
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from services.core.journal.dropped import JournalDropped
from services.core.journal.lmdb_store import LmdbStore
from services.core.journal.replay import JournalReplay
from services.core.journal.task_records import (
    NEXT,
    TERMINAL_STATES,
    ExactlyOnceError,
    JournalError,
    JournalFull,
    StalenessError,
    TaskRecord,
    TaskSpec,
    TaskState,
    check_staleness,
    step_key,
    task_key,
    unique,
)

__all__ = ["ExactlyOnceError", "Journal", "JournalError", "JournalFull", "StalenessError", "TaskRecord",
           "TaskSpec", "TaskState", "check_staleness"]

SCHEMA_VERSION = 1
DEFAULT_MAP_SIZE = 64 << 20  # 64 MiB; with writemap off this is address space, not disk
DEFAULT_MAX_MAP_SIZE = 64 << 30  # 64 GiB
_ITER_CHUNK = 1024

T = TypeVar("T")


_DB_NAMES = (b"tasks", b"live", b"meta", b"batches", b"results")


class Journal(JournalDropped, JournalReplay, LmdbStore):
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
        raw = txn.get(task_key(task_id), db=self._dbs[b"tasks"])
        if raw is None:
            raise JournalError(f"unknown task {task_id!r}")
        return TaskRecord.from_bytes(raw)

    def _store(self, txn: Any, rec: TaskRecord) -> None:
        txn.put(task_key(rec.task_id), rec.to_bytes(), db=self._dbs[b"tasks"])

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
        if target not in NEXT[rec.state]:
            raise JournalError(
                f"task {rec.task_id!r}: illegal transition {rec.state.value} -> {target.value}"
            )
        self._bump(txn, rec.state, -1)
        self._bump(txn, target, +1)
        rec.state = target
        rec.timestamps[target.value] = time.time()
        self._store(txn, rec)
        if target in TERMINAL_STATES:
            txn.delete(task_key(rec.task_id), db=self._dbs[b"live"])
        return True

    # -- task transitions --------------------------------------------------------------------

    def admit(self, tasks: Sequence[TaskSpec], cursor: int) -> int:
        """Write `tasks` as `admitted` and set the dataset cursor to `cursor`, in one transaction.

        Returns how many tasks were new. Re-admitting an identical admitted task is a no-op;
        re-admitting one that moved on, or with a different spec, raises. The cursor never goes
        backwards."""
        for t in tasks:
            task_key(t.task_id)

        def fn(txn: Any) -> int:
            current = self._get_int(txn, b"cursor")
            if cursor < current:
                raise JournalError(f"dataset cursor would go backwards: {current} -> {cursor}")
            step = self._get_int(txn, b"step")
            now = time.time()
            new = 0
            for spec in tasks:
                key = task_key(spec.task_id)
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
            prompts = len({t.dataset_index for t in tasks})
            if new:
                key = b"prompts:%d" % (step + 1)
                self._put_int(txn, key, self._get_int(txn, key) + prompts)
            self._put_int(txn, b"cursor", cursor)
            return new

        return self._write(fn)

    def mark_generated(self, task_ids: Iterable[str], version: int, batch_id: str) -> list[str]:
        """`admitted -> generated` under policy `version`, in rollout batch `batch_id`.

        Returns the tasks that moved; already-generated ones keep their first version (the first
        generation is the one whose results are kept put-if-absent)."""
        if version < 0:
            raise JournalError(f"policy version must be >= 0, got {version}")
        ids = unique(task_ids)

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
        ids = unique(task_ids)

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
                txn.put(step_key(step), batch, db=self._dbs[b"batches"])
            self._put_int(txn, b"step", step)

        self._write(fn)

    def mark_dead(self, task_ids: Iterable[str], reason: str) -> list[str]:
        """Any non-terminal state -> `dead(reason)`; returns the tasks that moved. An already dead
        task keeps its first reason; a trained task cannot die (it already counted)."""
        if not reason:
            raise JournalError("a dead task needs a reason")
        ids = unique(task_ids)

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
        key = task_key(task_id)

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
        """Admitted but not yet trained, dead or dropped: what admission control bounds."""
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
    def run_id(self) -> str | None:
        """The identity of the run this journal belongs to (`run_binding`), None before it is bound."""
        raw = self._read(lambda txn: txn.get(b"run_id", db=self._dbs[b"meta"]))
        return None if raw is None else bytes(raw).decode()

    def bind_run_id(self, run_id: str) -> None:
        """Store the run identity on first call; afterwards refuse a different one, so a journal is
        never resumed by another run's checkpoints."""

        def fn(txn: Any) -> None:
            raw = txn.get(b"run_id", db=self._dbs[b"meta"])
            if raw is None:
                txn.put(b"run_id", run_id.encode(), db=self._dbs[b"meta"])
            elif bytes(raw).decode() != run_id:
                raise JournalError(f"journal {self._path} belongs to run {bytes(raw).decode()!r}, not {run_id!r}")

        self._write(fn)

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
