"""`ProcessEngine`: any generation engine run in a child process of its own, behind the same interface.

Why: the actor trains the policy while its engine generates the next batch (`max_staleness` >= 1). In
one process the two share one GIL, and an engine whose step loop is Python-heavy (vLLM with per-token
log-probs) starves the training thread of the GIL it needs to launch kernels: on an H200 the update
ran at a fraction of its speed while generation was in flight (BENCHMARKS.md, "Reading the one-GPU
run"). A child process has its own interpreter, so generation and the update overlap for real.

How:
- The child is started with the `spawn` method (CUDA cannot be forked; a CPU transformers engine may fork
  from a preloaded forkserver, `start_context`) and builds the real engine
  with `backends.build_engine`; the parent waits for its `ready` message, or raises with the child's exit code.
  The child begins in `engines.child.main`, which watches the parent before anything heavy is imported
  (a child whose actor died, kill -9 or the OOM killer, exits at once, even while it is still
  starting), then runs `engines.serve.serve`, the child's side of the pipes.
- Requests (`generate`, `score`, `update_weights`, `describe`, `close`) go over one pipe, one at a
  time; `abort` goes over a second pipe that a control thread in the child serves while the main
  thread is busy generating, so an abort reaches a call in flight.
- Tensors travel through `torch.multiprocessing`'s reductions: CPU tensors by shared memory, CUDA
  tensors by CUDA IPC handles, so a weight sync copies nothing between processes; the child copies
  them into its model and drops its references before it answers. A child pinned to GPUs the
  trainer does not see gets its weights by broadcast instead (`transfer="collective"`,
  `services.models.weights.transfer`): the plan goes over the pipe, the buckets over NCCL or gloo.
- `pause`/`resume` and the in-flight count are kept in the parent, where every call passes.
- A child that dies makes every later call raise `EngineDied` (and `alive` False): the actor treats
  that as fatal and exits, and its supervisor restarts it (fail fast, as vLLM does with a dead worker).

The pipes carry only our own objects between a parent and the child it spawned; nothing crosses a
network boundary here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from services.core.observability.logs import current_service
from services.models.engine import (
    Completion,
    EngineError,
    EngineUnavailable,
    SamplingParams,
    WeightSyncError,
)
from services.models.engines import child as engine_child
from services.models.engines.gate import CallGate
from services.models.weights.check import WeightsMismatch, verdict_numbers, verify
from services.models.weights.transfer import Sender, backend_for

if TYPE_CHECKING:
    from services.models.engines.boot import StartedEngine

log = logging.getLogger(__name__)

# Exceptions re-raised in the parent as the same class; anything else becomes an EngineError.
_ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (
    EngineError, EngineUnavailable, WeightSyncError, ValueError, TypeError)}


# With RLFLEET_ENGINE_FORKSERVER=1, a CPU transformers engine's children fork from a server that
# imported torch, transformers and the engine once (multiprocessing's forkserver, started at this
# process's first such engine): the second and later engines of one process start in a fraction of a
# second instead of re-importing for 5-15 s on a 2-core host. For a process that makes many engines
# (the test suite's engine contract); an actor makes one, so it keeps `spawn`, whose child is its own
# (its process group, its stdio of now, a child of the actor), as CUDA and vLLM need anyway.
FORKSERVER_PRELOAD = ["services.models.engines.serve", "services.models.engines.hf_engine"]
FORKSERVER_ENV = "RLFLEET_ENGINE_FORKSERVER"


def start_context(name: str, device: str) -> Any:
    """The multiprocessing context an engine child of backend `name` on `device` starts in."""
    if name == "transformers" and device == "cpu" and os.environ.get(FORKSERVER_ENV) == "1":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        return ctx
    return mp.get_context("spawn")


class EngineDied(EngineError):
    """The engine's child process exited; the engine cannot serve any more calls."""


class ProcessEngine:
    """A `GenerationEngine` whose real engine (`name`, built by `build_engine`) lives in a child process."""

    def __init__(self, name: str, model_path: Path, start_timeout_s: float = 900.0, *,
                 visible_devices: str | None = None, label: str = "", threads: int | None = None,
                 transfer: str = "ipc", transfer_backend: str = "auto", transfer_bucket_bytes: int = 64 * 2**20,
                 transfer_timeout_s: float = 300.0, started: StartedEngine | None = None, **kw: Any) -> None:
        """`visible_devices` (CUDA_VISIBLE_DEVICES of the child) pins the engine to its GPUs; `label`
        names the process (e.g. the replica); `threads` caps the child's CPU threads (default: this
        process's). `transfer` is how weight syncs reach the child: "ipc" (by reference) or
        "collective" (broadcast over `transfer_backend`, auto/nccl/gloo, in buckets of
        `transfer_bucket_bytes`, bounded by `transfer_timeout_s`). `started`: the child
        `engines.boot.start_early` already spawned for this engine, to wait for instead of a new one."""
        if transfer not in ("ipc", "collective"):
            raise EngineError(f"unknown weight transfer {transfer!r}: use 'ipc' or 'collective'")
        if started is not None and (transfer != "ipc" or visible_devices is not None):
            started.stop()
            raise EngineError("an engine process started early takes its weights by reference on the"
                              " trainer's devices; this engine is pinned elsewhere or takes them by broadcast")
        self._sender: Sender | None = None
        if transfer == "collective":
            dtype = getattr(torch, str(kw.get("dtype", "float32")), None)
            self._sender = Sender(backend_for(str(kw.get("device", "cpu")), transfer_backend),
                                  timeout_s=transfer_timeout_s,
                                  bucket_bytes=transfer_bucket_bytes,
                                  engine_dtype=dtype if isinstance(dtype, torch.dtype) else None)
        if started is not None:
            self._conn, self._ctrl, self._proc, t0 = started.conn, started.ctrl, started.proc, started.t0
        else:
            ctx = start_context(name, str(kw.get("device", "cpu")))
            self._conn, child_conn = ctx.Pipe()
            self._ctrl, child_ctrl = ctx.Pipe()
            self._proc = ctx.Process(target=engine_child.main, name=f"engine-{name}{label}", daemon=True,
                                     args=(child_conn, child_ctrl, name, str(model_path), kw,
                                           threads or torch.get_num_threads(), visible_devices,
                                           self._sender.link if self._sender else None,
                                           (f"{svc}.engine{label}", logging.getLogger().getEffectiveLevel())
                                           if (svc := current_service()) else None,
                                           dict(os.environ) if ctx.get_start_method() == "forkserver" else None))
            t0 = time.monotonic()
            self._proc.start()
            child_conn.close()
            child_ctrl.close()
        self._lock = threading.Lock()  # one request on the main pipe at a time
        self._ctrl_lock = threading.Lock()
        self._gate = CallGate()  # a generate call carries the abort epoch it started in to the child
        self._dead: str | None = None
        try:
            msg = self._wait_ready(start_timeout_s)
        except BaseException:
            if self._sender is not None:
                self._sender.close()  # its store's port goes with the engine that did not start
            raise
        self._version = int(msg["version"])
        self._eos = tuple(int(t) for t in msg["eos"])
        self._describe = dict(msg["describe"], process=self._proc.pid, weight_transfer=transfer)
        self.last_sync: dict[str, float] = {}
        self._label, self._warned_unpaired = label, False
        self.stopped_for: str | None = None  # set when a sync failed its checksums (the process did not die)
        log.info("engine process started", extra={"engine": name, "pid": self._proc.pid, "early": started is not None,
                                                   "seconds": round(time.monotonic() - t0, 1)})

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise EngineDied(f"engine process exited with code {self._proc.exitcode} while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineError(f"engine process not ready within {timeout_s:.0f}s")
        msg = self._conn.recv()
        if msg[0] == "error":
            self._proc.join(10)
            raise _ERRORS.get(msg[1], EngineError)(msg[2])
        return msg[1]  # type: ignore[no-any-return]

    # -- the engine interface ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def in_flight(self) -> int:
        return self._gate.in_flight

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def describe(self) -> dict[str, Any]:
        return dict(self._describe)

    def _call(self, op: str, *args: Any, during: Callable[[], None] | None = None) -> Any:
        """One request and its answer; `during` runs between the two (the broadcasts of a weight
        sync, which the child receives while it serves the request)."""
        with self._lock:
            if self._dead is not None:
                raise EngineDied(self._dead)
            try:
                self._conn.send((op, args))
                if during is not None:
                    try:
                        during()
                    except Exception as err:
                        # The child is gone, or waits for broadcasts that will not come, or its answer
                        # would be read by the next request: this engine cannot be trusted any more.
                        self._proc.kill()
                        self._proc.join(5)
                        self._dead = (f"weight transfer to the engine process failed during {op}:"
                                      f" {type(err).__name__}: {str(err)[:300]}")
                        raise EngineDied(self._dead) from err
                msg = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                self._proc.join(5)
                self._dead = f"engine process died (exit code {self._proc.exitcode}) during {op}"
                raise EngineDied(self._dead) from None
        if msg[0] == "fatal":
            self._proc.join(10)
            self._dead = f"engine process stopped: {msg[2]}"
            raise EngineDied(self._dead)
        if msg[0] == "error":
            raise _ERRORS.get(msg[1], EngineError)(msg[2])
        return msg[1]

    @property
    def transfer_bucket_bytes(self) -> int | None:
        """Bytes per broadcast of a collective sync (None for by-reference syncs); settable between
        syncs, each plans its buckets afresh."""
        return self._sender.bucket_bytes if self._sender is not None else None

    @transfer_bucket_bytes.setter
    def transfer_bucket_bytes(self, n: int) -> None:
        if self._sender is None or n < 1:
            raise EngineError(f"transfer_bucket_bytes {n}: only a collective sync has buckets, of >= 1 byte")
        self._sender.bucket_bytes = int(n)

    @property
    def by_broadcast(self) -> bool:
        """Whether weight syncs reach the child as broadcasts (`transfer="collective"`), which read the
        trainer's tensors without changing them: a replica set may send several at once."""
        return self._sender is not None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        with self._gate.call() as epoch:
            out: list[Completion] = self._call("generate", prompts, params, epoch)
            return out

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out: list[list[float]] = self._call("score", sequences)
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Sync the weights, then check the child's checksums of what it holds against what was sent
        (`weights.check`): a mismatch kills the child and raises `WeightsMismatch`, the version unmoved."""
        t0 = time.perf_counter()
        if self._sender is not None:
            sender = self._sender
            buckets, tensors = sender.plan(named_tensors)
            sent = 0

            def broadcast() -> None:
                nonlocal sent
                sent = sender.send(tensors)

            answer = self._call("receive_weights", buckets, version, during=broadcast)
            # The reference is the planned tensors (cast, on the trainer's device), not the host copies
            # the sender staged: a fault in staging must show as a mismatch.
            planned = {n: t for b, ts in zip(buckets, tensors, strict=True) for n, t in zip(b.names, ts, strict=True)}
            checked = self._accept(answer, planned, version)
            self.last_sync = {"bytes": float(sent), "buckets": float(len(buckets)),
                              "seconds": time.perf_counter() - t0, **checked}
            return
        # Detached views: the child must not see autograd state, and CUDA IPC shares storage only.
        named = [(n, t.detach()) for n, t in named_tensors]
        checked = self._accept(self._call("update_weights", named, version), dict(named), version)
        self.last_sync = {"seconds": time.perf_counter() - t0, **checked}

    def _accept(self, answer: Any, sent: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Move to the child's version once its checksums match `sent`; on a mismatch the child is
        killed (it holds weights nobody sent: it must not generate again) and the error raised."""
        new_version, held = answer
        if held is None:  # an engine that cannot report its sums
            self._version = int(new_version)
            return {}
        t0 = time.perf_counter()
        try:
            verdict = verify(held, sent, version, who=f"engine{self._label}")
        except WeightsMismatch as err:
            self._proc.kill()
            self._proc.join(5)
            self._dead = self.stopped_for = str(err)
            log.error("weight sync failed its checksum check; the engine process is stopped",
                      extra={"version": version, "parameter": err.parameter, "engine": self._label or "engine"})
            raise
        if (verdict.unsent or verdict.unheld) and not self._warned_unpaired:
            self._warned_unpaired = True  # a layout this check does not map: said once, not every sync
            log.warning("weight checksums: some tensors could not be paired with the engine's parameters",
                        extra={"engine_only": len(verdict.unsent), "trainer_only": len(verdict.unheld),
                               "first": (verdict.unsent + verdict.unheld)[0]})
        self._version = int(new_version)
        return verdict_numbers(verdict, time.perf_counter() - t0)

    def pause(self) -> None:
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def abort(self) -> None:
        with self._ctrl_lock:
            if not self.alive:
                return
            epoch = self._gate.abort()
            try:
                self._ctrl.send(("abort", epoch))
                self._ctrl.recv()  # the child has aborted every call started before this one
            except (EOFError, OSError, BrokenPipeError):
                pass

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                with self._lock:
                    self._conn.send(("close", ()))
                    if self._conn.poll(30):
                        self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        if self._sender is not None:
            self._sender.close()
        self._dead = self._dead or "engine closed"
