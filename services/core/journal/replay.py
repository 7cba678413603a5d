"""`JournalReplay`: the part of the journal a restarted trainable service and a redelivered
message need. The training batches of every step since the oldest checkpoint of any trainable
service (replayed to a replacement restored from an older checkpoint, pruned once every service
has checkpointed past them), the checkpoint step each service acknowledged, and stage results
written put-if-absent (so a redelivery never counts twice). A mixin of `Journal`, using its
transactions."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from services.core.journal.task_records import JournalError, result_key, step_key

T = TypeVar("T")


class JournalReplay:
    _dbs: dict[bytes, Any]
    _trainable: tuple[str, ...]

    if TYPE_CHECKING:  # provided by LmdbStore and Journal; declared only for the type checker

        def _read(self, fn: Callable[[Any], T]) -> T: ...
        def _write(self, fn: Callable[[Any], T]) -> T: ...
        def _get_int(self, txn: Any, key: bytes, default: int = 0) -> int: ...
        def _put_int(self, txn: Any, key: bytes, value: int) -> None: ...

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
        key = step_key(step)
        self._write(lambda txn: txn.put(key, data, db=self._dbs[b"batches"]))

    def get_batch(self, step: int) -> bytes | None:
        key = step_key(step)
        raw = self._read(lambda txn: txn.get(key, db=self._dbs[b"batches"]))
        return None if raw is None else bytes(raw)

    def batches_after(self, service_checkpoint_step: int) -> list[tuple[int, bytes]]:
        """Batches of steps > `service_checkpoint_step`, oldest first: what a service restarted
        from that checkpoint must be replayed to catch up."""
        start = step_key(max(service_checkpoint_step + 1, 0))

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
        rk = result_key(key, stage)
        return bool(self._write(lambda txn: txn.put(rk, data, overwrite=False, db=self._dbs[b"results"])))

    def get_result(self, key: str, stage: str) -> bytes | None:
        rk = result_key(key, stage)
        raw = self._read(lambda txn: txn.get(rk, db=self._dbs[b"results"]))
        return None if raw is None else bytes(raw)
