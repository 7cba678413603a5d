"""Shared helpers for tests that run a real fleet or its engines: the embedded default config with
free ports, a private run directory and the session's prebuilt tiny model; new weights to sync."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.core.config.run import RunConfig, parse_config
from services.core.host.ports import pid_alive
from services.fleet import Fleet

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def tiny_config(run_dir: Path, model: Path, **sections: dict[str, Any]) -> RunConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"]["dir"] = str(run_dir)
    data["models"]["policy"]["path"] = str(model)
    data["services"] = {n: {"grpc_port": 0, "http_port": 0}
                        for n in ("controller", "actor", "critic", "reward", "reference")}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data, source="test config")


def controller_detail(fleet: Fleet) -> dict[str, Any]:
    try:
        return dict(fleet.status().get("controller", {}).get("detail", {}) or {})
    except Exception:
        return {}


def wait_for_step(fleet: Fleet, step: int, timeout_s: float = 120.0) -> float:
    """Block until the controller has finished `step` steps; returns the monotonic time it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if controller_detail(fleet).get("step", 0) >= step:
            return time.monotonic()
        ctl = fleet.procs.get("controller")
        if ctl is not None and not ctl.alive and ctl.proc.returncode == 0:
            return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError(f"fleet did not reach step {step} within {timeout_s}s")


def scrape(host: str, port: int) -> dict[str, float]:
    text = httpx.get(f"http://{host}:{port}/metrics", timeout=2).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gone(*pids: int, within_s: float = 20.0) -> bool:
    """Whether every process of `pids` exits within `within_s` seconds (a zombie waiting for its
    reaper has exited: `services.core.host.ports.pid_alive`)."""
    deadline = time.monotonic() + within_s
    while any(pid_alive(p) for p in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def processes_of(run_dir: Path) -> list[str]:
    """Live processes (zombies excluded) of a run: its command line names the run directory (a
    service's `--config RUN/fleet.yaml`) or it works inside it (redis-server, which rewrites its
    command line, runs in RUN/redis). "pid command" each; what a stopped fleet must leave: none."""
    root = str(run_dir.resolve())
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if state != "Z" and (root in cmd or cwd == root or cwd.startswith(root + os.sep)):
            out.append(f"{proc.name} {cmd[:200]}")
    return out


def commit_steps(journal: Any, steps: int) -> None:
    """Move a journal to step `steps` the way the controller does: each step admits one task, which
    is generated, scored by every stage and trained."""
    from services.core.ids import task_id
    from services.core.journal.journal import TaskSpec

    for step in range(journal.step + 1, steps + 1):
        tid = task_id(step - 1, 0)
        journal.admit([TaskSpec(tid, step - 1, 0, step - 1)], step)
        journal.mark_generated([tid], step - 1, f"b{step - 1}")
        for stage in sorted(journal.stages):
            journal.mark_stage_done([tid], stage)
        journal.mark_trained([tid], step, step - 1, 0)


def free_port() -> int:
    """A loopback port free now (the OS's pick)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_dist_node(port: int, log: Path, *, connect_timeout_s: float, new_session: bool = False) -> Any:
    """`python -m services.dist.node` as a worker pod runs it: node 1 of 2 with one rank, joining the
    leader's store on loopback `port`; its output appended to `log`."""
    import subprocess
    import sys

    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.dist.node", "--service", "actor", "--leader", "127.0.0.1",
             "--store-port", str(port), "--node-rank", "1", "--nodes", "2", "--gpus-per-node", "1",
             "--connect-timeout-s", str(connect_timeout_s)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session)


def perturbed_state(model_path: Path, seed: int, scale: float = 0.3) -> dict[str, Any]:
    """The model's state dict moved by seeded noise: a new version to sync into an engine."""
    import torch

    from services.models.io.loading import load_causal_lm

    m = load_causal_lm(model_path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return dict(m.state_dict())
