"""User reward code runs in a child process, so a reward that hangs costs a bounded time.

Why a process and not a thread with a deadline: Python cannot stop a thread, so a timed-out
reward would keep running (and holding the GIL, memory, maybe a lock of the user's) next to every
later batch, and a second hang would stack on the first. A process can be killed outright: on a
timeout the worker SIGKILLs its child, reports `reward_timeout` for the batch, and starts a fresh
child for the next one, so the service itself never stops. One child per process (the reward
service, the controller's evaluation) rather than a pool: batches are scored one at a time anyway,
and one child is one task load. A fresh interpreter (`python -m services.reward.worker`), not a
fork: the parent runs gRPC and asyncio threads that a fork would copy mid-state; and not a
multiprocessing child: a daemonic one could not start processes of its own (user code may), a
non-daemonic one is joined at exit. It talks over its own socket, so what user code prints cannot
corrupt the protocol. The child builds the task from the config itself, so only prompts,
completions and results cross, and it exits when its parent is gone (a watchdog on the parent's
pid: a SIGKILLed service leaves no reward process behind, even one stuck in user code).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from services.tasks.prompt import Prompt
from services.tasks.reward_rows import RowScores

if TYPE_CHECKING:
    from services.core.config.run import TaskSection

log = logging.getLogger("rlfleet.reward.worker")

# How often the child looks for its parent.
_PARENT_POLL_S = 0.5


class RewardStopped(Exception):
    """The reward could not score a batch at all: it ran past its timeout (`reward_timeout`) or its
    process died (`reward_crashed`, e.g. user code that called os._exit or segfaulted)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RewardWorker:
    """`score(prompts, completions)` in a child process, bounded by `timeout_s` per batch (its
    bisection included); the child is started by `start()` or on first use, and again after a
    timeout or a crash."""

    def __init__(self, section: TaskSection, timeout_s: float, start_timeout_s: float = 300.0) -> None:
        if not timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError(f"reward timeouts must be > 0, got {timeout_s} and {start_timeout_s}")
        self.section, self.timeout_s, self.start_timeout_s = section, timeout_s, start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._lock = threading.Lock()
        self.restarts = 0

    def start(self) -> None:
        """Spawn the child (it loads the task meanwhile); returns at once."""
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:
        if self._proc is not None:
            return
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.reward.worker", "--fd", str(theirs.fileno()),
                 "--parent", str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        conn = Connection(ours.detach())
        conn.send(self.section)
        self._proc, self._conn, self._ready = proc, conn, False

    def _wait_ready(self) -> None:
        assert self._conn is not None and self._proc is not None
        if self._ready:
            return
        if not self._conn.poll(self.start_timeout_s):
            self._stop()
            raise RuntimeError(f"the reward worker did not load the task within {self.start_timeout_s:g}s")
        try:
            kind, detail = self._conn.recv()
        except EOFError:
            code = self._proc.poll()
            self._stop()
            raise RuntimeError(f"the reward worker exited while loading the task (exit code {code})") from None
        if kind != "ready":
            self._stop()
            raise RuntimeError(f"the reward worker could not load the task: {detail}")
        self._ready = True

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> RowScores:
        with self._lock:
            self._spawn()
            self._wait_ready()
            assert self._conn is not None
            t0 = time.monotonic()
            try:
                self._conn.send((list(prompts), list(completions)))
                answered = self._conn.poll(self.timeout_s)
                reply = self._conn.recv() if answered else None
            except (EOFError, BrokenPipeError, ConnectionResetError):
                self._restart("crashed")
                raise RewardStopped("reward_crashed", f"the reward process died while scoring {len(prompts)}"
                                    " row(s); a new one is started") from None
            if reply is None:
                self._restart("timed out")
                raise RewardStopped("reward_timeout", f"the reward did not return within task.reward_timeout_s"
                                    f" ({self.timeout_s:g}s) on a batch of {len(prompts)} row(s); its process was"
                                    " killed and a new one is started")
            kind, detail = reply
            if kind != "ok":  # an error outside the user's reward (ours): the batch cannot be scored
                raise RuntimeError(f"the reward worker failed: {detail}")
            assert isinstance(detail, RowScores)
            if detail.failed:
                log.info("reward rows unscored", extra={"rows": len(prompts), "unscored": len(detail.failed),
                                                        "calls": detail.calls,
                                                        "seconds": round(time.monotonic() - t0, 3)})
            return detail

    def _restart(self, why: str) -> None:
        self.restarts += 1
        log.warning("reward process stopped; restarting it", extra={"why": why, "restarts": self.restarts,
                                                                     "timeout_s": self.timeout_s})
        self._stop()
        self._spawn()  # loads the task while the caller reports this batch

    def _stop(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc, self._conn, self._ready = None, None, False
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.kill()  # no-op on a child that already exited
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("reward process did not exit after SIGKILL", extra={"pid": proc.pid})

    def close(self) -> None:
        with self._lock:
            self._stop()


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child_main(conn: Connection, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    from services.tasks import load_task
    from services.tasks.reward_rows import score_rows

    try:
        task = load_task(conn.recv())
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}"[:500]))
        return
    conn.send(("ready", None))
    while True:
        try:
            prompts, completions = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed its end: nothing more to score
        try:
            reply: tuple[str, Any] = ("ok", score_rows(task.score, prompts, completions))
        except Exception as err:
            reply = ("error", f"{type(err).__name__}: {err}"[:500])
        conn.send(reply)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="services.reward.worker", description="a reward service's scoring child")
    ap.add_argument("--fd", type=int, required=True, help="the socket to its parent")
    ap.add_argument("--parent", type=int, required=True, help="the parent's pid: exit when it is gone")
    a = ap.parse_args(argv)
    _child_main(Connection(a.fd), a.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
