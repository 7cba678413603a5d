"""`ReplicaEngine`: M generation engines (data-parallel replicas) behind one `GenerationEngine`.

The actor of a device group of several GPUs generates on all of them: `generation.replicas: M` builds M
engines (each a `ProcessEngine`, pinned to its own GPUs, or all sharing one GPU with its memory split
M ways), and this class makes them one engine for the actor, keeping the contract of `engine.py`:

- `generate` spreads the prompts of one call over the replicas in contiguous slices (sizes differ by
  one at most), runs the slices concurrently and joins the completions in request order. Each slice
  carries `first_row`, the index of its first prompt in the call, and every backend seeds a row by
  (seed, first_row + i): the same request gives the same completions on 1 replica or on M.
- `update_weights` loads the tensors into every replica (by broadcast: all at once, each through
  its own group; by reference: one after the other), while no generate call
  runs (the gate holds new calls and waits for those in flight), and moves the version only once all
  have it: a generation never sees two versions. A strict check that fails fails on every replica alike
  (they hold the same model) before anything is changed; a replica that fails after another one took
  the new weights leaves the set inconsistent, so the engine turns dead (`alive` False) and the actor
  fails fast, as it does when an engine process dies. Each backend resets its own prefix cache.
- `pause`/`resume` and the in-flight count are this engine's own; `abort` reaches every replica.
- `alive` is False as soon as any replica is dead: the actor's engine watch then stops the service and
  its supervisor restarts it with all replicas fresh.

Where the replicas run (`replica_layout`) follows from the GPUs the actor sees (CUDA_VISIBLE_DEVICES,
as `rlfleet plan` / `rlfleet up` set it for the actor's device group): M x tensor_parallel_size GPUs
give each replica its own; fewer, with tensor_parallel_size 1, put the replicas round-robin on the
GPUs and split `gpu_memory_utilization` between the replicas of one GPU.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from services.models.engine import Completion, EngineError, GenerationEngine, SamplingParams
from services.models.engines.gate import CallGate
from services.models.weights.check import WeightsMismatch
from services.models.weights.sync import check_version

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicaSetBroken(EngineError):
    """The replicas no longer serve one version (a weight sync reached some and failed on others)."""


def spread(n: int, m: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) slices of n rows over at most m replicas, sizes differing by one at most,
    larger slices first; no empty slice (fewer rows than replicas leaves replicas idle)."""
    if m < 1:
        raise ValueError(f"replicas must be >= 1, got {m}")
    k = min(n, m)
    out, start = [], 0
    for r in range(k):
        size = n // k + (1 if r < n % k else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class ReplicaLayout:
    """Where each replica runs: `devices[r]` are the entries of the actor's CUDA_VISIBLE_DEVICES that
    replica r sees (empty: the CPU), `ordinals[r]` their positions in it, and `memory_share` the
    fraction of `gpu_memory_utilization` each replica takes (1/k with k replicas on one GPU)."""

    devices: tuple[tuple[str, ...], ...]
    ordinals: tuple[tuple[int, ...], ...]
    memory_share: float

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def visible_devices(self, r: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for replica r's process (None: inherit, the CPU case)."""
        return ",".join(self.devices[r]) if self.devices[r] else None


def replica_layout(replicas: int, tensor_parallel_size: int, gpus: Sequence[str]) -> ReplicaLayout:
    """Place `replicas` engines of `tensor_parallel_size` GPUs each on `gpus` (the actor's visible GPUs,
    as CUDA_VISIBLE_DEVICES lists them; empty on the CPU). Raises EngineError when they do not fit."""
    if replicas < 1 or tensor_parallel_size < 1:
        raise EngineError(f"replicas and tensor_parallel_size must be >= 1, got {replicas} and {tensor_parallel_size}")
    g, tp = len(gpus), tensor_parallel_size
    if g == 0:
        if tp > 1:
            raise EngineError(f"generation.tensor_parallel_size {tp} needs {tp} GPUs per replica; the actor sees none")
        return ReplicaLayout(tuple(() for _ in range(replicas)), tuple(() for _ in range(replicas)), 1.0)
    if g >= replicas * tp:
        ords = tuple(tuple(range(r * tp, (r + 1) * tp)) for r in range(replicas))
        share = 1.0
    elif tp == 1:
        ords = tuple((r % g,) for r in range(replicas))
        share = 1.0 / math.ceil(replicas / g)
    else:
        raise EngineError(f"generation.replicas {replicas} x tensor_parallel_size {tp} needs {replicas * tp} GPUs;"
                          f" the actor's device group has {g} (with tensor_parallel_size 1 replicas can share GPUs)")
    return ReplicaLayout(tuple(tuple(gpus[i] for i in o) for o in ords), ords, share)


class _Counters:
    """Per-replica throughput, for status and metrics: tokens generated and seconds spent generating."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens = 0
        self.seconds = 0.0
        self.calls = 0


class ReplicaEngine:
    """M `GenerationEngine`s serving as one (see the module docstring). Thread-safe like the engines."""

    def __init__(self, engines: Sequence[GenerationEngine], layout: ReplicaLayout | None = None) -> None:
        if not engines:
            raise EngineError("a replica set needs at least one engine")
        versions = {e.version for e in engines}
        if len(versions) != 1:
            raise EngineError(f"replicas start at different versions: {sorted(versions)}")
        self._engines = list(engines)
        self._layout = layout
        self._version = versions.pop()
        self._gate = CallGate()
        self._pool = ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="engine-replica")
        self._broken: str | None = None
        self.stopped_for: str | None = None  # a sync that failed its checksums stopped a replica
        self._counters = [_Counters() for _ in engines]

    # -- state ---------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[GenerationEngine]:
        return list(self._engines)

    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._engines[0].eos_token_ids

    @property
    def in_flight(self) -> int:
        return self._gate.in_flight

    @property
    def alive(self) -> bool:
        return self._broken is None and all(e.alive for e in self._engines)

    def dead_replicas(self) -> list[int]:
        return [r for r, e in enumerate(self._engines) if not e.alive]

    def describe(self) -> dict[str, Any]:
        return {"engine": "replicas", "replicas": len(self._engines), "version": self._version,
                "memory_share": self._layout.memory_share if self._layout else 1.0,
                "members": [self._describe(r) for r in range(len(self._engines))]}

    def _describe(self, r: int) -> dict[str, Any]:
        e = self._engines[r]
        d = getattr(e, "describe", None)
        out = dict(d()) if callable(d) else {"engine": type(e).__name__}
        out.update(replica=r, alive=e.alive, version=e.version)
        if self._layout is not None and self._layout.devices[r]:
            out["devices"] = list(self._layout.devices[r])
        return out

    def replica_stats(self) -> list[dict[str, Any]]:
        """One row per replica: tokens and seconds generated so far, its version, process, devices and
        how weight syncs reach it (with the last one's seconds)."""
        rows = []
        for r, (e, c) in enumerate(zip(self._engines, self._counters, strict=True)):
            with c.lock:
                row: dict[str, Any] = {"replica": r, "alive": e.alive, "version": e.version, "tokens": c.tokens,
                                       "generate_seconds": round(c.seconds, 3), "calls": c.calls}
            d = getattr(e, "describe", None)
            desc = dict(d()) if callable(d) else {}
            if desc.get("process"):
                row["pid"] = int(desc["process"])
            if desc.get("weight_transfer"):
                row["weight_transfer"] = str(desc["weight_transfer"])
            sync = getattr(e, "last_sync", None)
            if isinstance(sync, dict) and "seconds" in sync:
                row["last_sync_seconds"] = round(float(sync["seconds"]), 4)
            if self._layout is not None:
                row["ordinals"] = list(self._layout.ordinals[r])
            rows.append(row)
        return rows

    # -- calls ---------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._broken is not None:
            raise ReplicaSetBroken(self._broken)

    def _fan_out(self, fn: Callable[[int, int, int], list[T]], n: int) -> list[T]:
        """Run fn(replica, start, end) over the slices of n rows concurrently; join in row order. Every
        slice finishes (or fails) before this returns, so no replica keeps working for a call that is over."""
        futures = [self._pool.submit(fn, r, a, b) for r, (a, b) in enumerate(spread(n, len(self._engines)))]
        parts, error = [], None
        for f in futures:
            try:
                parts.append(f.result())
            except Exception as err:  # keep the first; wait for the rest
                error = error or err
        if error is not None:
            raise error
        return [x for part in parts for x in part]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        with self._gate.call():
            self._check()

            def run(r: int, a: int, b: int) -> list[Completion]:
                t0 = time.perf_counter()
                out = self._engines[r].generate(prompts[a:b], params.rows(a, b))
                c = self._counters[r]
                with c.lock:
                    c.tokens += sum(len(x.token_ids) for x in out)
                    c.seconds += time.perf_counter() - t0
                    c.calls += 1
                return out

            return self._fan_out(run, len(prompts))

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of `sequences`, spread over the replicas like `generate` (backends that score)."""
        with self._gate.call():
            self._check()
            return self._fan_out(lambda r, a, b: self._engines[r].score(sequences[a:b]),  # type: ignore[attr-defined]
                                 len(sequences))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = [(n, t.detach()) for n, t in named_tensors]  # every replica reads the same tensors
        def check() -> None:
            self._check()
            check_version(version, self._version)

        with self._gate.exclusive(check):
            # Broadcast syncs go to every replica at once (each through its own group; the wire, not
            # the trainer, is the bottleneck). By-reference ones one replica after the other: a CPU
            # tensor is moved to shared memory when first sent, which must not race with a second send.
            def sync(r: int) -> BaseException | None:
                try:
                    self._engines[r].update_weights(named, version)
                except Exception as err:
                    return err
                return None

            if len(self._engines) > 1 and all(getattr(e, "by_broadcast", False) for e in self._engines):
                errors = list(self._pool.map(sync, range(len(self._engines))))
            else:
                errors = []
                for r in range(len(self._engines)):
                    errors.append(sync(r))
                    if errors[-1] is not None:
                        break
            done = [r for r, err in enumerate(errors) if err is None]
            for r, err in enumerate(errors):
                if isinstance(err, WeightsMismatch):
                    # That replica holds weights nobody sent and is stopped: the set serves no more,
                    # whether or not another replica took the version already.
                    self._broken = self.stopped_for = f"replica {r}: {err}"
                    log.error("replica weight sync failed its checksum check",
                              extra={"version": version, "replica": r, "parameter": err.parameter})
                    raise WeightsMismatch(self._broken, version=version, parameter=err.parameter, held=err.held,
                                          sent=err.sent) from err
            for r, err in enumerate(errors):
                if err is None:
                    continue
                if done:
                    self._broken = (f"weight sync to version {version} reached replicas {done} but failed on"
                                    f" replica {r} ({type(err).__name__}: {err}); the replicas disagree")
                    log.error("replica weight sync failed midway",
                              extra={"version": version, "replica": r, "error": type(err).__name__})
                    raise ReplicaSetBroken(self._broken) from err
                raise err
            self._version = version

    def pause(self) -> None:
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def abort(self) -> None:
        self._gate.abort()
        for e in self._engines:
            e.abort()

    def close(self) -> None:
        for e in self._engines:
            try:
                e.close()
            except Exception as err:  # closing the others matters more than this one's error
                log.warning("closing a replica failed", extra={"error": type(err).__name__})
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._broken = self._broken or "engine closed"
