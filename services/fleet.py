"""`rlfleet up`: run a whole fleet on this host, one process per service, and supervise it.

The launcher resolves everything services must agree on (ports, Redis URL, model paths, absolute
run directory) once, writes it to `RUN_DIR/fleet.yaml`, and starts every service from that file.
A service that dies is restarted within a bounded budget; the run is done when the controller
exits 0 after its last step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml

from services.core.config.run import RunConfig, ServiceName, parse_config
from services.core.host import lifeline
from services.core.host.mps import MpsDaemon, MpsError
from services.core.host.placement import Inventory, PlacementError, Plan, discover_gpus
from services.core.host.ports import PortClaims, PortRequest, assign_ports
from services.core.host.redis_proc import RedisProcess, start_redis
from services.core.host.zygote import Zygote
from services.preflight import RunState, check_fleet
from services.prefork import Child, Launcher, base_env, forks, kill_group

log = logging.getLogger("rlfleet.fleet")


class FleetError(RuntimeError):
    pass


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the launcher (`Fleet.stop_on_signals`): stop everything it started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum  # `rlfleet up` exits 128 + signum, the shell's convention (130, 143)


def stop_line(signum: int) -> str:
    """What `rlfleet up` says when a signal stops it."""
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPT_GRACE_S = 10.0  # after a signal: how long services get to drain before SIGKILL
HARD_EXIT_S = 25.0  # after a signal: the launcher kills what it started and exits, whatever it is doing
STARTUP_GRACE_S, STARTUP_HARD_EXIT_S = 4.0, 9.0  # the two before all are ready: a Ctrl-C then ends it in 10 s


@dataclass
class ServiceProc:
    name: ServiceName
    proc: Child  # a subprocess.Popen, or a fork of the zygote with the same interface
    log_path: Path
    http_port: int
    restarts: int = 0
    replica: int = 0  # > 0: an extra replica of a stateless scorer, on ports it picks itself
    started_at: float = field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def port_requests(cfg: RunConfig, private_redis: bool = False) -> list[PortRequest]:
    """Every port the fleet binds: each needed service's gRPC and HTTP port (extra replicas pick
    their own), and a private redis-server's."""
    out = [PortRequest(f"{name} {key}", cfg.endpoint(name).host, getattr(cfg.endpoint(name), key),
                       f"services.{name}.{key}")
           for name in cfg.services_needed() for key in ("grpc_port", "http_port")]
    if private_redis:
        out.append(PortRequest("redis-server port", "127.0.0.1"))
    return out


def resolve_fleet_config(cfg: RunConfig, redis_url: str | None, ports: Mapping[str, int] | None = None) -> RunConfig:
    """Fill in what services must agree on: ports (`ports` from `assign_ports`, else distinct free
    ones for port 0), the Redis URL, absolute paths."""
    if ports is None:
        ports = assign_ports(port_requests(cfg), owner=f"pid {os.getpid()} resolving {cfg.run_dir}", check=False)
    data: dict[str, Any] = cfg.model_dump(mode="json")
    data["run"]["dir"] = str(cfg.run_dir.resolve())
    if redis_url is not None:
        data["redis"]["url"] = redis_url
    for name in cfg.services_needed():
        ep = data["services"].setdefault(name, cfg.endpoint(name).model_dump())
        for key in ("grpc_port", "http_port"):
            ep[key] = ports[f"{name} {key}"]
    pol = data["models"]["policy"]
    if pol["path"] is None:
        pol["path"] = str((cfg.run_dir / "models" / "policy").resolve())
    return parse_config(data, source="fleet config")


class Fleet:
    def __init__(self, cfg: RunConfig, restart_budget: int = 3, python: str = sys.executable,
                 inventory: Inventory | None = None, zygote: Zygote | None = None) -> None:
        """`zygote`: one the caller started (`services.prefork.start_zygote`) and stops, forked from
        instead of a zygote of the fleet's own (a test session shares one among its fleets)."""
        self.base_cfg = cfg
        self.inventory = inventory  # None: NVML, when the config has device groups
        self.run_dir = cfg.run_dir.resolve()
        self.restart_budget = restart_budget
        self.python = python
        self.launcher = Launcher(self.run_dir, python, zygote)  # Popen, or forks of a zygote (start_zygote)
        self.redis: RedisProcess | None = None
        self.mps: MpsDaemon | None = None  # run.cuda_mps
        self.procs: dict[str, ServiceProc] = {}
        self.cfg: RunConfig | None = None
        self.plan: Plan | None = None
        self.config_path = self.run_dir / "fleet.yaml"
        self.state: RunState | None = None
        self.ports: dict[str, int] | None = None
        self.owner = f"rlfleet up pid {os.getpid()}, run {self.run_dir}"
        self.stop_signal: int | None = None  # the SIGINT/SIGTERM that asked this launcher to stop
        self._holding = 0  # > 0: in a hold_signals block; a signal is recorded, raised after it
        self._stopping = False
        self._nothing_started = False
        self._claimed = False  # ports claimed host-wide (reserve_ports): stop releases them
        self.ready = False  # every service answered /readyz once (start returned)

    # -- signals ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the launcher at any moment of start-up or supervision. The first
        raises `Interrupted` where the launcher is (or right after the `hold_signals` block it came
        in), and is recorded too, since a library can swallow the exception: torch's import
        initialises numpy from C and drops any error raised meanwhile, KeyboardInterrupt included,
        and the run then went on as if no signal had come. So every step of start-up and every
        supervision tick checks the record (`check_stop`). A watchdog kills whatever still runs
        HARD_EXIT_S after the signal, and exits; a second signal does that at once. Only `rlfleet
        up` (the main thread of its own process) uses this."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        hook = sys.unraisablehook

        def unraisable(u: Any) -> None:
            # A signal that lands in a finalizer (a garbage-collected object's __del__) raises Interrupted
            # there, where Python can only print it with a traceback and drop it. The signal is recorded
            # all the same, and the next step's check_stop raises it where it can be handled.
            if not isinstance(u.exc_value, Interrupted):
                hook(u)

        sys.unraisablehook = unraisable
        try:
            yield
        finally:
            sys.unraisablehook = hook
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is not None:
            self._hard_exit(signum, "rlfleet up: second signal: killed the fleet")
        self.stop_signal = signum
        if self._holding and self._nothing_started:
            # An import that must not be interrupted (see hold_signals), with nothing to stop yet.
            self._hard_exit(signum, f"{stop_line(signum)}: nothing was started yet")
        threading.Thread(target=self._watchdog, args=(signum,), name="stop-watchdog", daemon=True).start()
        if not self._holding and not self._stopping:
            raise Interrupted(signum)

    def _watchdog(self, signum: int) -> None:
        after = HARD_EXIT_S if self.ready else STARTUP_HARD_EXIT_S
        time.sleep(after)
        self._hard_exit(signum, f"rlfleet up: still stopping {after:.0f}s after the signal: killed the fleet")

    def _hard_exit(self, signum: int, line: str) -> None:
        self.kill()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a reentrant flush (from a signal handler) raises
                stream.flush()
        with contextlib.suppress(OSError):
            os.write(2, f"{line}\n".encode())
        os._exit(128 + signum)  # what a port claim of this pid holds is dropped by the next launcher

    def check_stop(self) -> None:
        """Raise `Interrupted` if a signal asked this launcher to stop (and was swallowed on the way)."""
        if self.stop_signal is not None and not self._stopping:
            raise Interrupted(self.stop_signal)

    @contextlib.contextmanager
    def hold_signals(self, nothing_started: bool = False) -> Iterator[None]:
        """A stop signal that arrives in this block is recorded and raised right after it. For what
        an exception must not interrupt: starting a child and recording it (else an orphan nothing
        stops), and importing torch, which drops the exception or aborts the process on it (raised
        in a callback of its C++ code: `terminate called after throwing ... KeyboardInterrupt`).
        `nothing_started`: no child runs yet (the imports before Redis starts), so a signal need not
        wait for the block to end: the launcher exits at once. Otherwise bounded by the watchdog."""
        before = self.stop_signal
        self._holding += 1
        self._nothing_started = nothing_started and not self.procs and self.redis is None
        try:
            yield
        finally:
            self._holding -= 1
            self._nothing_started = False
        if before is None:  # one raised before this block has been dealt with by who caught it
            self.check_stop()

    # -- start-up --------------------------------------------------------------------------------
    def preflight(self) -> RunState:
        """Every check that needs nothing started (placement, run directory, task, models, Redis
        binary), in about a second; what the run directory already holds."""
        if self.state is None:
            self.plan = self.place(self.base_cfg)  # an impossible placement stops here
            self.state = check_fleet(self.base_cfg)
        return self.state

    def reserve_ports(self) -> dict[str, int]:
        """Choose (and claim host-wide) every port the fleet binds, and check each is free, before
        anything binds one: "<service> grpc_port" / "<service> http_port" / "redis-server port"."""
        if self.ports is None:
            self._claimed = True
            private_redis = self.base_cfg.redis.url is None
            self.ports = assign_ports(port_requests(self.base_cfg, private_redis), owner=self.owner)
        return self.ports

    def prepare(self) -> RunConfig:
        from services.models.roles.paths import given_by_path

        # A policy given by path needs no build: preflight checked its directory, and the services
        # load it themselves, so Redis and the services start without the launcher importing torch.
        build = not given_by_path(self.base_cfg.models.policy, "policy", self.run_dir)
        self.preflight()
        self.start_zygote()  # its imports overlap the launcher's own, Redis's start and the model's build
        if build:
            with self.hold_signals(nothing_started=True):  # loads transformers and torch: see hold_signals
                from services.models.roles import resolve as roles

                roles.import_builders()  # the model code roles.prepare may build with (services import it lazily)
        ports, private_redis, redis_url = self.reserve_ports(), self.base_cfg.redis.url is None, None
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.check_stop()
        if private_redis:
            with self.hold_signals():  # bounded: start_redis gives up after 10s
                self.redis = start_redis(self.run_dir / "redis", port=ports["redis-server port"],
                                         password=self.base_cfg.redis_password(), die_with_parent=True)
                lifeline.record(self.run_dir, "redis-server", self.redis.proc.pid)
            redis_url = f"redis://{self.redis.host}:{self.redis.port}/0"  # password travels via env only
            log.info("redis started", extra={"pid": self.redis.proc.pid})
        if self.base_cfg.run.cuda_mps and self.mps is None:
            with self.hold_signals():  # bounded: each control call gives up after 10 s
                try:
                    self.mps = MpsDaemon.start()
                except MpsError as err:
                    raise FleetError(str(err)) from None
        cfg = resolve_fleet_config(self.base_cfg, redis_url, ports)
        if build:  # once here, so services never race to build it
            roles.prepare(cfg)
        log.info("models prepared", extra={"given_by_path": not build})
        self.check_stop()
        self.config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self.cfg = cfg
        return cfg

    def place(self, cfg: RunConfig) -> Plan | None:
        """Pin each service to its device group's GPUs, as `rlfleet plan` does for docker compose.
        A config without device groups, or a host without GPUs, runs unpinned; a group that cannot
        be placed on the GPUs present fails here, before anything starts."""
        if not cfg.devices:
            return None
        from services.plan import make_plan

        inv = self.inventory if self.inventory is not None else discover_gpus()
        if not inv.gpus:
            log.warning("device groups ignored: no GPUs on this host", extra={"reason": inv.reason})
            return None
        try:
            plan = make_plan(cfg, inv)
        except PlacementError as err:
            raise FleetError(f"device groups cannot be placed on this host's GPUs ({inv.source}): {err}") from None
        for name, group in plan.service_groups.items():
            log.info("placed", extra={"child": name, "group": group, "gpus": plan.gpu_ids(name) or "none"})
        return plan

    def start_zygote(self) -> None:
        """Start the zygote CPU services fork from (`services.prefork`) if any will: after preflight (the placement)."""
        cfg = self.cfg or self.base_cfg
        if any(forks(cfg, name, self.plan is not None) for name in cfg.services_needed()):
            with self.hold_signals():  # started and recorded, or not started: see hold_signals
                self.launcher.start_zygote()

    def service_env(self, name: ServiceName, replica: int = 0) -> dict[str, str]:
        env = base_env()  # os.environ, and the launcher's pid for the service's lifeline
        if self.plan is not None:
            # A service without a device group sees no GPU at all: nothing lands on one by accident.
            env.update(self.plan.service_env(name, replica))
        if self.mps is not None:
            env.update(self.mps.env)
        return env

    def _spawn(self, name: ServiceName, replica: int = 0) -> ServiceProc:
        assert self.cfg is not None
        key = f"{name}-{replica}" if replica else name
        log_path = self.run_dir / "logs" / f"{key}.log"
        argv = ["--config", str(self.config_path)] + (["--replica", str(replica)] if replica else [])
        proc = self.launcher.spawn(f"services.{name}", argv, self.service_env(name, replica), log_path,
                                   fork=forks(self.cfg, name, self.plan is not None), check=self.check_stop)
        return ServiceProc(name, proc, log_path, self.cfg.endpoint(name).http_port, replica=replica)

    def start(self, ready_timeout_s: float = 180.0) -> None:
        cfg = self.cfg or self.prepare()
        self.start_zygote()  # again after a stop
        # Scorers and the actor before the controller, which admits as soon as it is ready; but the forks
        # of the zygote after all others: they may wait for its imports, and the others' use the core it
        # leaves idle meanwhile (what the controller admits waits in Redis: groups read from the start).
        order = sorted(cfg.services_needed(), key=lambda n: (forks(cfg, n, self.plan is not None), n == "controller"))
        for name in order:
            self._launch(name, name)  # type: ignore[arg-type]
            for k in range(1, cfg.endpoint(name).replicas):  # type: ignore[arg-type]
                self._launch(f"{name}-{k}", name, replica=k)  # type: ignore[arg-type]
        self.wait_ready(ready_timeout_s)
        self.ready = True

    def _launch(self, key: str, name: ServiceName, replica: int = 0, restarts: int = 0) -> None:
        self.check_stop()
        with self.hold_signals():
            sp = self._spawn(name, replica)
            sp.restarts = restarts
            self.procs[key] = sp
            lifeline.record(self.run_dir, key, sp.proc.pid)
        log.info("service started", extra={"child": key, "pid": sp.proc.pid, "restarts": restarts})

    def http(self, name: str, path: str, timeout: float = 2.0) -> httpx.Response:
        assert self.cfg is not None
        sp = self.procs.get(name)
        if sp is not None and sp.replica:
            # Replicas pick free ports; their state file says which.
            info = read_service_files(self.run_dir).get(name) or {}
            if info.get("pid") != sp.proc.pid or not info.get("http_port"):
                raise httpx.ConnectError(f"{name} has not published its ports yet")
            return httpx.get(f"http://{info['host']}:{info['http_port']}{path}", timeout=timeout)
        ep = self.cfg.endpoint(name)  # type: ignore[arg-type]
        return httpx.get(f"http://{ep.host}:{ep.http_port}{path}", timeout=timeout)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.procs)
        while waiting:
            self.check_stop()
            for name in list(waiting):
                sp = self.procs[name]
                if not sp.alive:
                    raise FleetError(f"{name} exited with code {sp.proc.returncode} while starting:"
                                     f" {last_error(sp.log_path)} (log: {sp.log_path})")
                try:
                    if self.http(name, "/readyz").status_code == 200:
                        waiting.discard(name)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise FleetError(f"services not ready after {timeout_s:.0f}s: {', '.join(sorted(waiting))}")
            time.sleep(0.2)

    # -- supervision -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, sp in self.procs.items():
            row: dict[str, Any] = {"pid": sp.proc.pid, "alive": sp.alive, "restarts": sp.restarts}
            try:
                row.update(self.http(name, "/v1/status", timeout=1.0).json())
            except (httpx.HTTPError, ValueError):
                row["state"] = "unreachable" if sp.alive else "exited"
            out[name] = row
        return out

    def supervise(self, on_tick: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 0.2,
                  timeout_s: float | None = None) -> int:
        """Run until the controller finishes; restart dead services within the budget."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.check_stop()
            ctl = self.procs["controller"]
            if not ctl.alive and ctl.proc.returncode == 0:
                return 0
            for name, sp in list(self.procs.items()):
                if sp.alive or (name == "controller" and sp.proc.returncode == 0):
                    continue
                if sp.proc.returncode == 0:
                    # Drained on purpose (`rlfleet swap`, a rolling update): start the replacement.
                    log.info("service drained; starting its replacement", extra={"child": name})
                    self._launch(name, sp.name, sp.replica, restarts=sp.restarts)
                    continue
                if sp.proc.returncode == 2:
                    # Exit code 2 is a configuration the service cannot run with (services.core.serving.entry,
                    # services.core.serving.runtime): a restart would meet it again, so the run stops on its line.
                    raise FleetError(f"{name} stopped: {last_error(sp.log_path)} (log: {sp.log_path})")
                if sp.restarts >= self.restart_budget:
                    raise FleetError(f"{name} died {sp.restarts + 1} times (restart budget {self.restart_budget});"
                                     f" last exit code {sp.proc.returncode}: {last_error(sp.log_path)}"
                                     f" (log: {sp.log_path})")
                log.warning("service died; restarting",
                            extra={"child": name, "code": sp.proc.returncode, "restarts": sp.restarts + 1})
                self._launch(name, sp.name, sp.replica, restarts=sp.restarts + 1)
            if on_tick is not None:
                on_tick(self.status())
            if deadline is not None and time.monotonic() > deadline:
                raise FleetError(f"run did not finish within {timeout_s:.0f}s")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every service (controller first, so nothing new is admitted), SIGKILL the process
        group of any still running after `grace_s`, then stop Redis and release the ports. Bounded;
        a signal that arrives meanwhile does not interrupt it (a second one kills at once)."""
        self._stopping = True
        try:
            self._stop(grace_s)
        finally:
            self._stopping = False

    def _stop(self, grace_s: float) -> None:
        order = sorted(self.procs, key=lambda n: n != "controller")
        for name in order:
            sp = self.procs[name]
            if sp.alive:
                with contextlib.suppress(ProcessLookupError):
                    sp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for sp in self.procs.values():
            try:
                sp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.log(  # one still starting (a short grace): expected, so in the launcher's log only
                    logging.WARNING if self.ready else logging.INFO, "service did not stop in time; killing it",
                    extra={"child": sp.name, "pid": sp.proc.pid, "grace_s": grace_s})
                kill_group(sp.proc)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    sp.proc.wait(timeout=5)
        self.launcher.stop()  # after the services: its children would get SIGTERM from its exit
        if self.redis is not None:
            self.redis.stop()
        if self.mps is not None:  # after the services: the daemon's server exits with its last client
            self.mps.stop()
            self.mps = None
        lifeline.forget(self.run_dir)  # everything it names is stopped
        if self._claimed:
            PortClaims().release(self.owner)
            self._claimed = False
        self.ports = None

    def kill(self) -> None:
        """SIGKILL everything this launcher started, at once (no drain, no wait); safe from any thread."""
        for sp in list(self.procs.values()):
            kill_group(sp.proc)
        self.launcher.kill()
        if self.redis is not None:
            with contextlib.suppress(OSError):
                self.redis.proc.kill()
        if self.mps is not None:
            self.mps.quit_nowait()


def last_error(path: Path) -> str:
    """The last error a service logged, on one line: its message and the exception's last line
    (the whole traceback stays in the log)."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return "no log written"
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and str(rec.get("level", "")).lower() in ("error", "critical"):
            msg = str(rec.get("msg", ""))
            exc = str(rec.get("exc") or "").strip().splitlines()
            last = exc[-1].split(": ", 1)[-1] if exc else ""
            return msg if last in msg else f"{msg}: {exc[-1]}"
    # Died before its logging was set up (an import error, a signal): the last line it printed.
    plain = [ln.strip() for ln in lines if ln.strip()]
    return plain[-1][:500] if plain else "no error logged"


def read_service_files(run_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for f in sorted((run_dir / "services").glob("*.json")):
        try:
            out[f.stem] = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out
