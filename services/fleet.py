"""`rlfleet up`: run a whole fleet on this host, one process per service, and supervise it.

The launcher resolves everything services must agree on (ports, Redis URL, model paths, absolute
run directory) once, writes it to `RUN_DIR/fleet.yaml`, and starts every service from that file.
A service that dies is restarted within a bounded budget; the run is done when the controller
exits 0 after its last step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.core.config import RunConfig, ServiceName, parse_config
from services.core.placement import Inventory, PlacementError, Plan, discover_gpus
from services.core.redis_proc import RedisProcess, free_port, start_redis

log = logging.getLogger("rlfleet.fleet")


class FleetError(RuntimeError):
    pass


@dataclass
class ServiceProc:
    name: ServiceName
    proc: subprocess.Popen[bytes]
    log_path: Path
    http_port: int
    restarts: int = 0
    replica: int = 0  # > 0: an extra replica of a stateless scorer, on ports it picks itself
    started_at: float = field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def resolve_fleet_config(cfg: RunConfig, redis_url: str | None) -> RunConfig:
    """Fill in what services must agree on: free ports for port 0, the Redis URL, absolute paths."""
    data: dict[str, Any] = cfg.model_dump(mode="json")
    data["run"]["dir"] = str(cfg.run_dir.resolve())
    if redis_url is not None:
        data["redis"]["url"] = redis_url
    for name in cfg.services_needed():
        ep = data["services"].setdefault(name, cfg.endpoint(name).model_dump())
        for key in ("grpc_port", "http_port"):
            if not ep[key]:
                ep[key] = free_port(ep["host"])
    pol = data["models"]["policy"]
    if pol["path"] is None:
        pol["path"] = str((cfg.run_dir / "models" / "policy").resolve())
    return parse_config(data, source="fleet config")


class Fleet:
    def __init__(self, cfg: RunConfig, restart_budget: int = 3, python: str = sys.executable,
                 inventory: Inventory | None = None) -> None:
        self.base_cfg = cfg
        self.inventory = inventory  # None: NVML, when the config has device groups
        self.run_dir = cfg.run_dir.resolve()
        self.restart_budget = restart_budget
        self.python = python
        self.redis: RedisProcess | None = None
        self.procs: dict[str, ServiceProc] = {}
        self.cfg: RunConfig | None = None
        self.plan: Plan | None = None
        self.config_path = self.run_dir / "fleet.yaml"

    # -- start-up --------------------------------------------------------------------------------
    def prepare(self) -> RunConfig:
        from services.models.roles import prepare as prepare_models

        self.plan = self.place(self.base_cfg)  # before anything starts: an impossible placement stops here
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        redis_url = None
        if self.base_cfg.redis.url is None:
            self.redis = start_redis(self.run_dir / "redis", password=self.base_cfg.redis_password())
            redis_url = f"redis://{self.redis.host}:{self.redis.port}/0"  # password travels via env only
        cfg = resolve_fleet_config(self.base_cfg, redis_url)
        # Build the tiny model once here, so services never race to build it.
        prepare_models(cfg)
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
            log.info("placed", extra={"service": name, "group": group, "gpus": plan.gpu_ids(name) or "none"})
        return plan

    def service_env(self, name: ServiceName) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.plan is not None:
            # A service without a device group sees no GPU at all: nothing lands on one by accident.
            env.update(self.plan.service_env(name))
        return env

    def _spawn(self, name: ServiceName, replica: int = 0) -> ServiceProc:
        assert self.cfg is not None
        key = f"{name}-{replica}" if replica else name
        log_path = self.run_dir / "logs" / f"{key}.log"
        env = self.service_env(name)
        args = [self.python, "-m", f"services.{name}", "--config", str(self.config_path)]
        if replica:
            args += ["--replica", str(replica)]
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops services in order
            )
        return ServiceProc(name, proc, log_path, self.cfg.endpoint(name).http_port, replica=replica)

    def start(self, ready_timeout_s: float = 180.0) -> None:
        cfg = self.cfg or self.prepare()
        # Scorers and the actor first: the controller starts admitting as soon as it is ready.
        order = [n for n in cfg.services_needed() if n != "controller"] + ["controller"]
        for name in order:
            self.procs[name] = self._spawn(name)  # type: ignore[arg-type]
            for k in range(1, cfg.endpoint(name).replicas):  # type: ignore[arg-type]
                self.procs[f"{name}-{k}"] = self._spawn(name, replica=k)  # type: ignore[arg-type]
        self.wait_ready(ready_timeout_s)

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
            for name in list(waiting):
                sp = self.procs[name]
                if not sp.alive:
                    raise FleetError(f"{name} exited with code {sp.proc.returncode} while starting; "
                                     f"see {sp.log_path}:\n{tail(sp.log_path)}")
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

    def supervise(self, on_tick: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 0.5,
                  timeout_s: float | None = None) -> int:
        """Run until the controller finishes; restart dead services within the budget."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ctl = self.procs["controller"]
            if not ctl.alive and ctl.proc.returncode == 0:
                return 0
            for name, sp in list(self.procs.items()):
                if sp.alive or (name == "controller" and sp.proc.returncode == 0):
                    continue
                if sp.proc.returncode == 0:
                    # Drained on purpose (`rlfleet swap`, a rolling update): start the replacement.
                    log.info("service drained; starting its replacement", extra={"service": name})
                    new = self._spawn(sp.name, sp.replica)
                    new.restarts = sp.restarts
                    self.procs[name] = new
                    continue
                if sp.restarts >= self.restart_budget:
                    raise FleetError(f"{name} died {sp.restarts + 1} times (restart budget {self.restart_budget});"
                                     f" last exit code {sp.proc.returncode}; see {sp.log_path}:\n{tail(sp.log_path)}")
                log.warning("service died; restarting",
                            extra={"service": name, "code": sp.proc.returncode, "restarts": sp.restarts + 1})
                new = self._spawn(sp.name, sp.replica)
                new.restarts = sp.restarts + 1
                self.procs[name] = new
            if on_tick is not None:
                on_tick(self.status())
            if deadline is not None and time.monotonic() > deadline:
                raise FleetError(f"run did not finish within {timeout_s:.0f}s")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> None:
        # Controller first so nothing new is admitted, then the workers, then Redis.
        order = sorted(self.procs, key=lambda n: n != "controller")
        for name in order:
            sp = self.procs[name]
            if sp.alive:
                sp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for sp in self.procs.values():
            try:
                sp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                sp.proc.kill()
                sp.proc.wait(timeout=5)
        if self.redis is not None:
            self.redis.stop()


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def read_service_files(run_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for f in sorted((run_dir / "services").glob("*.json")):
        try:
            out[f.stem] = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out


def swap(run_dir: Path, service: str, token: str | None = None, timeout_s: float = 180.0) -> dict[str, float]:
    """Hot-swap one service of a running local fleet: drain it (it finishes in-flight work,
    checkpoints and exits 0), let the supervisor start its replacement, and wait until the new
    process reports ready. Returns the timings."""
    files = read_service_files(run_dir)
    if service not in files:
        raise FleetError(f"no running service {service!r} in {run_dir / 'services'} (found: {', '.join(files)})")
    info = files[service]
    old_pid = int(info["pid"])
    base = f"http://{info['host']}:{info['http_port']}"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/drain", headers=headers, timeout=5.0)
    if r.status_code >= 300:
        raise FleetError(f"{service} refused to drain: HTTP {r.status_code} {r.text[:200]}")
    deadline = t0 + timeout_s
    while _pid_alive(old_pid):
        if time.monotonic() > deadline:
            raise FleetError(f"{service} (pid {old_pid}) did not exit within {timeout_s:.0f}s of drain")
        time.sleep(0.1)
    t_exit = time.monotonic()
    while True:
        new = read_service_files(run_dir).get(service, {})
        if new.get("pid") not in (None, old_pid) and new.get("state") == "ready":
            try:
                if httpx.get(f"http://{new['host']}:{new['http_port']}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise FleetError(f"no ready replacement for {service} within {timeout_s:.0f}s")
        time.sleep(0.2)
    t_ready = time.monotonic()
    return {"drain_s": t_exit - t0, "replacement_ready_s": t_ready - t_exit, "total_s": t_ready - t0,
            "old_pid": float(old_pid), "new_pid": float(new["pid"])}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False
