"""The processes of a phase: started in a session of their own, bounded in time, and stopped (a
measured fleet at once, without its drain), and the tail of their logs."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.vs_trl.workload import REPO, say


def run_proc(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    say("$", " ".join(cmd), f"(cap {timeout_s:.0f} s, log {log})")
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env or os.environ.copy(),
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return 124


def kill_group(proc: subprocess.Popen[Any]) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_fleet(proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> bool:
    """End a measured `rlfleet up` at once: two SIGTERMs are its "kill the fleet now" (every service's
    process group, Redis, then its own exit), with no drain, final checkpoint or export. Falls back to
    killing the launcher's group. True once the launcher has exited."""
    import signal

    for _ in range(2):
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
    return proc.poll() is not None
