"""Start the actor's engine process first, before the actor imports torch and builds its trainer.

Why: an engine in its own process (`generation.process`) spent ~13 s importing torch and vLLM before
vLLM began to start, and the actor spawned it only after its own ~17 s of imports and the trainer
model's load: one after the other, ~30 s of the fleet's time to first step on an H200 (BENCHMARKS.md,
the run of 2026-12-02 13:08). Spawned here, the engine's imports overlap the actor's.

How: `start_early` runs in the actor's process before anything imports torch (`services.core.serving.entry`
calls it once the config is valid) and spawns the same child `ProcessEngine` would, with the options
`make_engine` would pass it, by way of `engines.child.main`, so this module stays free of torch.
`make_engine` `take`s that child when it asks for the same engine and waits for its `ready` as it would
for its own; a request for anything else stops it and starts a new one. Only a single engine process
that gets its weights by CUDA IPC (or on the CPU) starts early: replicas, tensor parallelism and
collective weight transfers keep their own start, which needs torch in this process.

The actor waits for the engine before it loads the trainer's model (`services.actor.server`), so vLLM's
memory profiling does not count the trainer's first allocations as its own; where nothing profiles
(`GenerationSection.starts_beside_trainer`: a fixed `generation.vllm.kv_cache_gib`, or another engine)
it builds and compiles the trainer while the engine starts.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from services.core.config.run import RunConfig
from services.core.observability.logs import current_service
from services.core.serving.entry import torch_threads
from services.models.engines import child as engine_child
from services.models.weights.route import route

log = logging.getLogger(__name__)

# make_engine's own arguments; the rest of GenerationSection.engine_kwargs goes to the engine's child.
_FACTORY_ARGS = ("process", "replicas", "tensor_parallel_size", "weight_transfer", "weight_transfer_backend",
                 "weight_transfer_bucket_mb", "weight_transfer_timeout_s")


@dataclass
class StartedEngine:
    """A spawned engine child whose `ready` has not been read yet."""

    name: str
    model_path: str
    kw: dict[str, Any]
    proc: BaseProcess
    conn: Connection
    ctrl: Connection
    t0: float  # time.monotonic() at the spawn

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.conn.close()
        self.ctrl.close()


_started: StartedEngine | None = None


def child_options(cfg: RunConfig) -> dict[str, Any] | None:
    """What the actor's `make_engine` call will pass to its engine's child, or None where that engine
    does not start as one child process with weights by reference."""
    g = cfg.generation
    if cfg.models.policy.path is None or not g.process or g.replicas > 1 or g.tensor_parallel_size > 1:
        return None
    if route(g.weight_transfer, shares_trainer_device=True) != "ipc":  # one engine process: the actor's device
        return None
    kw = g.engine_kwargs(cfg.run_dir)
    return {"dtype": g.engine_dtype(cfg.models.policy.dtype),
            **{k: v for k, v in kw.items() if k not in _FACTORY_ARGS}}


def start_early(cfg: RunConfig) -> None:
    """Spawn the actor's engine process now, where its configuration allows (`child_options`)."""
    global _started
    kw = child_options(cfg)
    if kw is None or _started is not None or cfg.models.policy.path is None:
        return
    # As make_engine will see it: the actor passes Path(models.policy.path).
    name, path = cfg.generation.engine, str(Path(cfg.models.policy.path))
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    ctrl, child_ctrl = ctx.Pipe()
    svc = current_service()
    log_to = (f"{svc}.engine", logging.getLogger().getEffectiveLevel()) if svc else None
    proc = ctx.Process(target=engine_child.main, name=f"engine-{name}", daemon=True,
                       args=(child_conn, child_ctrl, name, path, kw, torch_threads(), None, None, log_to))
    t0 = time.monotonic()
    proc.start()
    child_conn.close()
    child_ctrl.close()
    _started = StartedEngine(name, path, kw, proc, conn, ctrl, t0)
    log.info("engine process spawned early", extra={"engine": name, "pid": proc.pid})


def take(name: str, model_path: str, kw: dict[str, Any]) -> StartedEngine | None:
    """The early engine process when it is the engine asked for (it is then this caller's to close);
    else None, after stopping one that is not."""
    global _started
    early, _started = _started, None
    if early is None:
        return None
    if (early.name, early.model_path, early.kw) != (name, model_path, kw):
        log.warning("the engine process started early is not the engine asked for; starting another",
                    extra={"engine": name})
        early.stop()
        return None
    return early
