"""What ties the processes `rlfleet up` starts to the launcher's life, and what finds those that outlived it.

Why: a launcher killed by SIGKILL (as a user does to one that seems hung) runs no cleanup, and its
services and redis-server went on with parent 1 for good, holding the run directory, its ports and
the journal (one reward service then ignored SIGTERM too).

How, for a service: the launcher names itself in `RLFLEET_LAUNCHER_PID`; `watch_launcher`, the first
thing a service does, asks the kernel for SIGTERM at the launcher's death (Linux PR_SET_PDEATHSIG:
at once, even in the middle of an import) and starts a thread that polls the parent's pid (the
portable fallback, and the deadline): once the launcher is gone the service gets SIGTERM, so it
drains, and EXIT_GRACE_S later the thread SIGKILLs the service's process group (it leads one), its
children with it. The parent-death signal follows the launcher *thread* that spawned the child, so
the launcher asks for it only when it spawns from its main thread (`launcher_env`).

For redis-server, which runs no code of ours: it is started through `python -m services.core.host.lifeline
PID -- redis-server ...`, which sets the parent-death signal and execs the server (the setting
survives the exec, and the pid stays the server's).

A stray: the launcher records every pid it starts in RUN_DIR/processes.json (with each process's
start time, so a reused pid is not mistaken for it); a later `rlfleet up` on the directory names
whichever of them still run (`holders`) instead of starting a second fleet beside them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("rlfleet.lifeline")

LAUNCHER_ENV = "RLFLEET_LAUNCHER_PID"
PDEATHSIG_ENV = "RLFLEET_PDEATHSIG"  # "1": the launcher spawned from its main thread (see the module doc)
EXIT_GRACE_S = 5.0  # from the launcher's death to SIGKILL of a service that has not drained by then
POLL_S = 0.5
RECORD = "processes.json"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def launcher_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child of this launcher: it names the launcher, and asks for the parent-death
    signal when the spawning thread is the main one (a worker thread's exit must not end a service)."""
    out = dict(env, **{LAUNCHER_ENV: str(os.getpid())})
    out[PDEATHSIG_ENV] = "1" if threading.current_thread() is threading.main_thread() else "0"
    return out


def watch_launcher(poll_s: float = POLL_S, grace_s: float = EXIT_GRACE_S) -> bool:
    """In a service started by `rlfleet up`: stop this process within seconds of the launcher's
    death (see the module doc). False, doing nothing, in a service that no launcher started."""
    raw = os.environ.get(LAUNCHER_ENV, "")
    if not raw.isdigit():
        return False
    launcher = int(raw)
    if os.environ.get(PDEATHSIG_ENV) == "1":
        set_parent_death_signal(signal.SIGTERM)
    # Its children inherit the environment: only this process watches this launcher.
    os.environ.pop(LAUNCHER_ENV, None)
    os.environ.pop(PDEATHSIG_ENV, None)

    def watch() -> None:
        # getppid() against the recorded pid: a launcher dead before this line has handed us on already.
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.error("the launcher is gone; stopping", extra={"launcher_pid": launcher, "grace_s": grace_s})
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), signal.SIGTERM)  # a drain, where no parent-death signal came
        time.sleep(grace_s)
        log.error("still running after the launcher's death; killed", extra={"launcher_pid": launcher})
        logging.shutdown()
        with contextlib.suppress(OSError):
            if os.getpgrp() == os.getpid():  # leads its group (start_new_session): its children too
                os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()
    return True


def wrap_command(args: list[str]) -> list[str]:
    """`args` run through this module, so that the program dies with this process (redis-server)."""
    return [sys.executable, "-m", "services.core.host.lifeline", str(os.getpid()), "--", *args]


# -- the run directory's record ---------------------------------------------------------------------


def start_time(pid: int) -> str | None:
    """An identity for process `pid` that a later process with the same pid does not share (its start
    time); None when it is not running (a zombie counts as not running)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return None if fields[0] in ("Z", "X") else fields[19]
    p = subprocess.run(["ps", "-o", "stat=,lstart=", "-p", str(pid)], capture_output=True, text=True, check=False)
    out = p.stdout.strip()
    return None if not out or out.startswith("Z") else out.split(None, 1)[-1]


def record(run_dir: Path, name: str, pid: int) -> None:
    """Note in RUN_DIR/processes.json that this launcher started `name` as process `pid`."""
    path = run_dir / RECORD
    data = _read(path)
    data[name] = {"pid": pid, "started": start_time(pid)}
    if "launcher" not in data:
        data["launcher"] = {"pid": os.getpid(), "started": start_time(os.getpid())}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def forget(run_dir: Path) -> None:
    """Drop the record: every process it names has been stopped."""
    with contextlib.suppress(OSError):
        (run_dir / RECORD).unlink()


def holders(run_dir: Path) -> list[str]:
    """"name pid N" for each recorded process still running (this one excluded), in record order."""
    out = []
    for name, rec in _read(run_dir / RECORD).items():
        pid = rec.get("pid") if isinstance(rec, dict) else None
        if not isinstance(pid, int) or pid == os.getpid():
            continue
        started = start_time(pid)
        if started is not None and started == rec.get("started"):
            out.append(f"{name} pid {pid}")
    return out


def _read(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _exec_with_parent() -> None:
    """`python -m services.core.host.lifeline PID -- PROGRAM ARGS...`: exec PROGRAM, dying with process PID."""
    parent, sep, *args = sys.argv[1:]
    if sep != "--" or not args or not parent.isdigit():
        sys.exit("usage: python -m services.core.host.lifeline PARENT_PID -- PROGRAM [ARGS...]")
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(parent):  # died before the signal was asked for: it would never come
        sys.exit(1)
    os.execvp(args[0], args)


if __name__ == "__main__":
    _exec_with_parent()
