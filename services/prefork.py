"""How `rlfleet up` starts a service's process: a fork of the fleet's zygote (`services.core.host.zygote`)
where that is safe and pays, else `subprocess.Popen` of `python -m services.<name>`.

Forked: the services that import torch and transformers (actor, reference, critic), when they run on
the CPU: they skip ~6 s of imports at every start and restart (the zygote's module doc has the
numbers). Started as before:
- the controller and the reward service, which import neither (tests/unit/test_service_imports.py):
  a fork would give them the zygote's torch for nothing, and they start in about a second anyway;
- any service with a device group or a CUDA device, an actor whose engine is vLLM or on a GPU, and
  every service of a fleet under CUDA MPS: torch's import does not initialise CUDA, but a fork is not
  worth a doubt there, where the imports are a small part of the start;
- everything when `RLFLEET_ZYGOTE=0` (the escape hatch, and the baseline for timing the difference).

A zygote that cannot serve (it refused, died, or did not answer) is dropped with a warning, and the
services it would have forked start with Popen from then on: slower, never worse.

A fleet starts a zygote of its own, stopped with it. A process that launches many fleets (the test
session) may start one with `start_zygote` and hand it to each (`Fleet(zygote=...)`): they fork from
it and leave it running, and only the first pays for its imports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

from services.core.config.run import RunConfig, ServiceName
from services.core.host import lifeline
from services.core.host.zygote import Zygote, ZygoteChild, ZygoteError

log = logging.getLogger("rlfleet.fleet")

ENV = "RLFLEET_ZYGOTE"  # "0": every service starts with Popen
FORKED: tuple[ServiceName, ...] = ("actor", "reference", "critic")
READY_TIMEOUT_S = 120.0  # a zygote not ready by then (a host loaded far beyond CI's) is given up on
# What the zygote imports: torch, transformers' modelling stack, the web and Redis clients every
# service uses, and the torch-side modules of the forked services. Nothing that imports grpc (the
# zygote refuses to serve then; tests/unit/test_zygote.py checks this list).
PRELOAD = (
    "torch", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
    "transformers.modeling_layers", "transformers.generation", "transformers.models.auto.modeling_auto",
    "numpy", "pydantic", "yaml", "httpx", "redis.asyncio", "fastapi", "uvicorn", "prometheus_client",
    "services.core.config.run", "services.core.observability.logs", "services.models.io.loading",
    "services.models.nets.logprobs", "services.models.nets.critic", "services.rl.trainer",
    "services.reference.scorer", "services.dist.build", "services.dist.group", "services.models.engines.boot",
)

Child: TypeAlias = subprocess.Popen[bytes] | ZygoteChild


def forks(cfg: RunConfig, name: ServiceName, placed: bool) -> bool:
    """Whether service `name` starts as a fork of the zygote (the module doc says when); `placed`:
    the fleet pins services to GPUs (a placement plan)."""
    if os.environ.get(ENV, "1") == "0" or placed or cfg.run.cuda_mps or name not in FORKED:
        return False
    ep = cfg.endpoint(name)
    if ep.device != "cpu" or ep.device_group is not None:
        return False
    g = cfg.generation
    return name != "actor" or (g.engine == "transformers" and g.device == "cpu")


def base_env() -> dict[str, str]:
    """The environment every service starts from (a zygote too): this process's, unbuffered, naming
    this launcher for the service's lifeline."""
    env = lifeline.launcher_env(dict(os.environ, PYTHONUNBUFFERED="1"))  # it stops if this launcher dies
    # Set by wandb.init in the launching process: inherited, every controller would share that
    # process's wandb-core, and a killed controller's W&B run would stay "in use" for its replacement.
    env.pop("WANDB_SERVICE", None)
    return env


def start_zygote(log_path: Path, python: str = sys.executable, run_dir: Path | None = None) -> Zygote:
    """A zygote importing PRELOAD with `base_env`, logging to `log_path`; `run_dir` names the run on its
    command line (and its forks')."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return Zygote.start(python=python, env=base_env(), log_path=log_path, preload=PRELOAD, run_dir=run_dir)


def popen(module: str, argv: Sequence[str], env: dict[str, str], log_path: Path,
          python: str) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [python, "-m", module, *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops services in order
        )


class Launcher:
    """Starts a fleet's service processes (`spawn`): forks of `zygote` (the caller's, which it keeps
    running) or of one `start_zygote` starts, else Popen."""

    def __init__(self, run_dir: Path, python: str, zygote: Zygote | None = None) -> None:
        self.run_dir = run_dir
        self.python = python
        self.zygote = zygote
        self._shared = zygote is not None  # the caller's: never stopped here
        self._dropped = False  # a zygote failed in this run: Popen until `stop`

    def start_zygote(self) -> None:
        """Start the fleet's zygote (once; it imports while the launcher goes on), unless it has one."""
        if self.zygote is not None or self._dropped:
            return
        self.zygote = start_zygote(self.run_dir / "logs" / "zygote.log", self.python, self.run_dir)
        lifeline.record(self.run_dir, "zygote", self.zygote.pid)
        log.info("zygote started", extra={"pid": self.zygote.pid})

    def spawn(self, module: str, argv: Sequence[str], env: dict[str, str], log_path: Path, *, fork: bool,
              check: Callable[[], None] = lambda: None) -> Child:
        """Start `python -m module *argv`: forked when `fork` and a zygote serves, else with Popen.
        Waits for a zygote still importing, calling `check` (which may raise to stop) meanwhile."""
        z = self.zygote
        if fork and z is not None:
            t0 = time.monotonic()
            while not z.wait_ready(0.1) and z.alive and time.monotonic() - t0 < READY_TIMEOUT_S:
                check()
            try:
                if not z.ready:
                    raise ZygoteError(z.refused or ("not running" if not z.alive else
                                                    f"not ready after {READY_TIMEOUT_S:.0f}s"))
                return z.spawn(module, argv, env, log_path)
            except ZygoteError as err:
                log.warning("zygote dropped; services start with Popen", extra={"error": str(err), "child": module})
                self._drop()
        return popen(module, argv, env, log_path, self.python)

    def _drop(self) -> None:
        self._dropped = True
        if self.zygote is not None:
            self.zygote.kill()  # a child it forked but did not report dies with it, not unseen (shared too)
            self.zygote.stop(timeout=1.0)
            self.zygote = None

    def stop(self) -> None:
        """Stop the fleet's own zygote, after the services: children it still has get SIGTERM from its exit."""
        if self.zygote is not None and not self._shared:
            self.zygote.stop()
            self.zygote = None
        self._dropped = False

    def kill(self) -> None:
        """SIGKILL the fleet's own zygote; safe from a signal handler or any thread."""
        z = self.zygote
        if z is not None and not self._shared:
            z.kill()


def kill_group(proc: Child) -> None:
    """SIGKILL a service and what it started: it leads its own process group (start_new_session).
    Only while it is not reaped, so its pid (the group id) cannot belong to another process yet."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            with contextlib.suppress(OSError):
                proc.kill()
