"""Where an engine's child process begins: it watches its parent before it imports torch or the engine.

Why: the actor's engine process (`engines.proc`, maybe spawned by `engines.boot` before the actor imports
torch) spends tens of seconds starting (importing torch and vLLM, loading the model, compiling graphs)
before it reads its pipe, and only that read told it that the actor was gone. An actor killed by
SIGKILL or the OOM killer in that window left an orphan that went on to take its share of the GPU,
next to the engine of the restarted actor, whose memory profiling then counted the orphan's.

How: `main`, the target that both spawn, starts a daemon thread that polls the parent's pid, then
imports the engine. Once the parent is gone the child SIGKILLs what it started (vLLM's EngineCore),
logs one line and exits with `EXIT_ORPHANED`. A poll rather than PR_SET_PDEATHSIG: that signal follows
the parent *thread* that spawned (an engine spawned from a worker thread would die with it), and it
would end this process without its line and without its own children. This module stays torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from services.core.observability.logs import setup_logging

if TYPE_CHECKING:
    from services.models.weights.transfer import Link

log = logging.getLogger(__name__)

EXIT_ORPHANED = 3  # as a dist follower whose rank 0 is gone
POLL_S = 0.5

_parent: int | None = None  # the process that started this one
_os_parent: int | None = None  # its OS parent while that lives: the spawner, or the forkserver it asked
_spawner: Any = None  # multiprocessing's handle on the spawner (its sentinel), where it has one
_exiting = threading.Lock()  # the watch and the pipe's reader may both see the parent go: one line, one exit


def main(conn: Connection, ctrl: Connection, name: str, path: str, kw: dict[str, Any], threads: int,
         visible_devices: str | None = None, link: Link | None = None, log_to: tuple[str, int] | None = None,
         env: dict[str, str] | None = None) -> None:
    """The engine process: `engines.serve.serve` with `log_to` (service name, level) as its logging, under
    a watch of its parent. `env`: the parent's environment, for a child forked from a forkserver (which
    holds the environment of the moment it started, not the parent's of now)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if log_to is not None:
        # A spawned child starts with logging unconfigured: without this its records (start-up time,
        # weight loads, the reason it gives up, the watch's last word) would not reach the service's log.
        setup_logging(log_to[0], level=log_to[1])
    watch_parent()
    from services.models.engines.serve import serve  # torch and the engine: seconds of imports, watched

    # Its pipe closed without a `close`: a dead parent's pipes close just before the kernel hands this
    # process to another, so this exit, not the watch's a moment later, is the one that logs.
    if serve(conn, ctrl, name, path, kw, threads, visible_devices, link) and parent_gone(wait_s=2 * POLL_S):
        exit_orphaned()


def watch_parent(poll_s: float = POLL_S) -> None:
    """Exit this process (`exit_orphaned`) within `poll_s` of its parent's death."""
    global _parent, _os_parent, _spawner
    _spawner = multiprocessing.parent_process()
    # The spawner's pid, not getppid() now: a parent that died before this line has already handed
    # this process to another, and its death would go unseen. Its sentinel (a pipe the spawner holds
    # open) says so too, and is the one sign for a child forked by a forkserver, whose OS parent is the
    # server (which exits with the spawner, so a change of the OS parent means the same).
    _parent = _spawner.pid if _spawner is not None and _spawner.pid is not None else os.getppid()
    _os_parent = os.getppid()

    def watch() -> None:
        while not parent_gone():
            time.sleep(poll_s)
        exit_orphaned()

    threading.Thread(target=watch, daemon=True, name="engine-parent-watch").start()


def parent_gone(wait_s: float = 0.0) -> bool:
    """Whether the watched parent has died, waiting up to `wait_s` for it to: its pipes close before
    the kernel hands its children to another process."""
    deadline = time.monotonic() + wait_s
    while _parent is not None and os.getppid() == _os_parent and (_spawner is None or _spawner.is_alive()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return _parent is not None


def exit_orphaned() -> None:
    """Kill this process's descendants, log why and exit at once (no traceback, no cleanup that could hang)."""
    _exiting.acquire()
    try:
        killed = 0
        for pid in _descendants(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        # A warning, not an error: the launcher reports a service's last error as the reason it died,
        # and the actor's own reason is not this.
        log.warning("engine process exits: the process that started it is gone",
                    extra={"parent": _parent, "children_killed": killed})
    finally:
        os._exit(EXIT_ORPHANED)


def _descendants(root: int) -> list[int]:
    """Every process below `root`, parents before their children (Linux /proc; none elsewhere). This
    process does not lead a process group of its own (spawn keeps the actor's), so no killpg."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out
