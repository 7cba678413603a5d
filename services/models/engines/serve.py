"""The engine's child process, after `engines.child.main`: builds the real engine and serves the requests
`engines.proc.ProcessEngine` sends over its pipes (protocol in `engines.proc`'s docstring).

Kept apart from both: `engines.child` must stay torch-free to watch the parent before the engine's imports,
and `engines.proc`, the parent's side, spawns `engines.child.main`; this module imports neither."""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from services.models.engine import Completion, EngineError, GenerationEngine, StreamingWeights, WeightsTorn
from services.models.engines.backends import build_engine
from services.models.weights.check import corrupt, held_by
from services.models.weights.transfer import Bucket, Link, Receiver


def serve(conn: Connection, ctrl: Connection, name: str, path: str, kw: dict[str, Any], threads: int,
           visible_devices: str | None = None, link: Link | None = None) -> bool:
    """The engine process, once `engines.child.main` has set up its logging and the watch of its parent.
    True when it returns because its pipe closed without a `close` (the parent may be dead)."""
    if visible_devices is not None:
        # Before anything touches CUDA: this engine (a replica) sees only its own GPUs.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    torch.set_num_threads(threads)
    try:
        engine = build_engine(name, Path(path), **kw)
        receiver = Receiver(link, device=kw.get("device")) if link is not None else None
    except Exception as err:
        conn.send(("error", type(err).__name__, str(err)))
        return False

    # Abort covers every call the parent had started before it aborted (epoch < aborted), including
    # one this process has received but not yet handed to the engine: such a call returns at once, and
    # one that enters the engine just as the abort arrives is aborted again once it is in.
    state = threading.Lock()
    aborted, running = 0, None

    def control() -> None:
        nonlocal aborted
        while True:
            try:
                op, epoch = ctrl.recv()
            except (EOFError, OSError):
                return
            if op == "abort":
                with state:
                    aborted = max(aborted, epoch)
                    active = running is not None
                if active:
                    engine.abort()
                    while running is not None and engine.in_flight == 0:
                        time.sleep(0.001)
                    if running is not None:
                        engine.abort()
            ctrl.send("ok")

    threading.Thread(target=control, daemon=True, name="engine-control").start()
    conn.send(("ready", {"version": engine.version, "eos": tuple(engine.eos_token_ids),
                         "describe": describe(engine)}))
    lost = False
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            lost = True
            break
        if op == "close":
            conn.send(("ok", None))
            break
        try:
            if op == "generate":
                prompts, params, epoch = args
                with state:
                    late = epoch < aborted
                    running = None if late else epoch
                try:
                    out: Any = ([Completion([], [], "abort") for _ in prompts] if late
                                else engine.generate(prompts, params))
                finally:
                    with state:
                        running = None
            elif op == "score":
                out = engine.score(*args)  # type: ignore[attr-defined]
            elif op == "receive_weights":
                if receiver is None:
                    raise EngineError("this engine process was started without a weight-transfer link")
                receive_weights(engine, receiver, *args)
                out = (engine.version, held_by(engine))  # the parent checks the sums before it trusts them
            elif op == "update_weights":
                named, version = args
                engine.update_weights(list(corrupt(named, version)), version)
                if torch.cuda.is_initialized():
                    # Copies out of the parent's tensors may still be queued: the parent trains on
                    # those tensors again as soon as this call returns.
                    torch.cuda.synchronize()
                del named, args  # release shared tensors (CUDA IPC) before the parent reuses them
                out = (engine.version, held_by(engine))
            elif op == "describe":
                out = describe(engine)
            else:
                raise EngineError(f"unknown engine request {op!r}")
            conn.send(("ok", out))
        except WeightsTorn as err:
            # Two versions in one model: this engine must not serve again.
            conn.send(("fatal", type(err).__name__, str(err)))
            break
        except Exception as err:
            conn.send(("error", type(err).__name__, str(err)))
    engine.close()
    return lost


def receive_weights(engine: GenerationEngine, receiver: Receiver, buckets: list[Bucket], version: int) -> None:
    stream = receiver.stream(buckets)
    got = (list(corrupt(b, version)) for b in stream)
    try:
        if isinstance(engine, StreamingWeights):
            shapes = {n: s for b in buckets for n, s in zip(b.names, b.shapes, strict=True)}
            engine.update_weights_stream(shapes, got, version)
        else:
            engine.update_weights([x for bucket in got for x in bucket], version)
    finally:
        receiver.drain(stream)  # a refused sync still takes every broadcast, so both sides stay in step


def describe(engine: GenerationEngine) -> dict[str, Any]:
    d = getattr(engine, "describe", None)
    return dict(d()) if callable(d) else {"engine": type(engine).__name__}
