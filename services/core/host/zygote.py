"""A fork server: one process imports torch and transformers' modelling code once, and each service
that needs them starts as a fork of it (`Zygote.spawn`) instead of a fresh interpreter.

Why: the actor, the reference and the critic each spent ~6.5 s of CPU importing torch and transformers
(`transformers.modeling_utils` alone pulls in `conversion_mapping`, `finegrained_fp8` and
`torch.distributed.tensor`, which no tiny CPU model needs but every `PreTrainedModel` subclass
imports) at every start and restart. On 2 cores with the whole fleet importing at once that bounded
each fleet start at ~15 s, and each restart of a killed service at ~7.5 s.

How: the launcher starts `python -m services.core.host.zygote --fd N` with a socketpair; the zygote
imports its `--preload` modules, says `ready`, then serves JSON lines: `spawn` (module, argv, env,
log file) is answered `spawned` with the child's pid, and the zygote, its only reaper, reports each
child's `exited` with the exit code `subprocess.Popen.returncode` would have (negative: a signal).
The child leads a session of its own (setsid, like `start_new_session`), takes the request's
environment wholesale, stdin from /dev/null and stdout and stderr to its log file, and runs the
module as `python -m` would (`runpy`, as `__main__`). Its exit status is the one that module's exit
gives the interpreter, but reached as a fork exits (`os._exit`, as multiprocessing's forked children
do) once the exit handlers ran: the interpreter's finalization would then tear down every module torch
and transformers loaded, ~2 s of CPU per stop of an actor or a reference on a 2-core host, for nothing
a service still needs (its work ends with its drain: journal closed, checkpoint written, engine
stopped).
`ZygoteChild` is the launcher's handle, with the part of `subprocess.Popen`'s interface it uses.

What a fork inherits, and why that is safe here:
- threads: none of Python's (the zygote refuses to serve if its preload started one). numpy's
  OpenBLAS starts a worker thread at import, and shuts it down around a fork itself (pthread_atfork).
- gRPC, whose state does not survive a fork: never imported here (the zygote refuses to serve if a
  preloaded module pulled it in); each child imports it after the fork.
- CUDA: torch's import does not initialise it; the launcher forks only services on the CPU anyway.
- the environment: what a library reads at import time (HF_HOME, HF_HUB_OFFLINE, ...) comes from the
  zygote's, which is the launcher's; what code reads at run time comes from the request.
- random state: Python's `random` reseeds itself in a fork and numpy's global generator is reseeded
  here; torch's default generator starts from the same fixed seed in every process anyway.
- file descriptors: the control socket and the zygote's wake-up pipe are closed in the child; the
  zygote opens nothing else.

Lifelines (`services.core.host.lifeline`): the zygote dies with the launcher (the parent-death signal,
and a check of its parent's pid every POLL_S), and its children die with the zygote: each child's
`RLFLEET_LAUNCHER_PID` names the zygote, its parent, so `watch_launcher` (the first thing a service
does) asks for SIGTERM at the zygote's death. A killed zygote thus takes its children down; the
launcher cannot learn their exit codes then, and reports `LOST_RETURNCODE` for each once it is gone.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.core.host import lifeline
from services.core.observability.logs import setup_logging

log = logging.getLogger("rlfleet.zygote")

MODULE = "services.core.host.zygote"
POLL_S = 0.5  # how often the zygote checks that its launcher is alive, where no parent-death signal can come
REPLY_TIMEOUT_S = 10.0  # a spawn the zygote does not answer by then: it is taken for broken
# The exit code reported for a child whose zygote died before it (its real status went with the
# zygote): the SIGTERM that the zygote's death sent it.
LOST_RETURNCODE = -signal.SIGTERM


class ZygoteError(RuntimeError):
    """The zygote cannot start this child: not running, refused to serve, or did not answer."""


# -- the zygote process ------------------------------------------------------------------------------


@dataclass
class SpawnRequest:
    id: int
    module: str
    argv: list[str]
    env: dict[str, str]
    log: str
    cwd: str | None = None


def preload(modules: Sequence[str]) -> str | None:
    """Import `modules`; why the result is not safe to fork, or None. A module that fails to import
    is skipped (the service that needs it fails as it would have, in its own log)."""
    for name in modules:
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as err:
            log.warning("preload failed; skipped", extra={"import": name, "error": f"{type(err).__name__}: {err}"})
            continue
        log.info("preloaded", extra={"import": name, "seconds": round(time.monotonic() - t0, 2)})
    if "grpc" in sys.modules:
        return "a preloaded module imports grpc, whose state does not survive a fork"
    if threading.active_count() > 1:
        return f"preloading started threads: {sorted(t.name for t in threading.enumerate())}"
    return None


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"event": "exited", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket, launcher: int | None) -> SpawnRequest | None:
    """Answer spawn requests until the launcher closes the socket or dies (None, in the zygote). In a
    forked child it returns that child's request, with the zygote's state (signals, fds) undone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    # A Python-level handler, so that SIGCHLD writes to the wake-up fd and select returns at once.
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    buf = b""
    while True:
        if launcher is not None and os.getppid() != launcher:
            log.error("the launcher is gone; exiting", extra={"launcher_pid": launcher})
            return None
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [], POLL_S)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(sock)
        if sock.fileno() not in readable:
            continue
        data = sock.recv(1 << 20)
        if not data:
            log.info("the launcher closed the control socket; exiting")
            return None
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = SpawnRequest(**json.loads(line))
            zygote = os.getpid()
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as err:
                _send(sock, {"event": "failed", "id": req.id, "error": f"fork: {err}"})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                sock.close()
                # The child's lifeline is its parent, this zygote (see the module doc).
                req.env[lifeline.LAUNCHER_ENV] = str(zygote)
                req.env[lifeline.PDEATHSIG_ENV] = "1"  # this process has one thread: the one that forked
                return req
            _send(sock, {"event": "spawned", "id": req.id, "pid": pid})
            log.info("spawned", extra={"child": req.module, "pid": pid})


def run_child(req: SpawnRequest) -> None:
    """In the fork: become what `python -m MODULE ARGV...` started by `subprocess.Popen` would be."""
    os.setsid()  # first: the launcher stops a service with its process group
    out = os.open(req.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if req.cwd is not None:
        os.chdir(req.cwd)
    os.environ.clear()
    os.environ.update(req.env)
    if "numpy" in sys.modules:  # a fresh process draws its own seed (Python's random reseeds at fork)
        sys.modules["numpy"].random.seed()
    sys.argv = [req.module, *req.argv]
    code = 0
    try:
        runpy.run_module(req.module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except KeyboardInterrupt:
        _leave()
        # As the interpreter does: die by the signal, so the parent sees -SIGINT as from Popen.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)  # the signal is blocked: the shell's code for it
    except BaseException:
        traceback.print_exc()
        code = 1
    _leave()
    os._exit(code)


def _exit_status(code: object) -> int:
    """What the interpreter makes of `sys.exit(code)`: None is 0, an int itself, anything else printed
    to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _leave() -> None:
    """The part of the interpreter's exit a forked child still needs: the exit handlers (the service's
    own and its libraries': multiprocessing's ends the child processes it started, logging's flushes
    the handlers), then stdio flushed. Not the joining of non-daemon threads (a drained service has
    none left; a wedged one would hold the exit) nor the teardown of every module."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _tie_to_launcher() -> int | None:
    """The launcher's pid, after asking for SIGTERM at its death (`lifeline.watch_launcher`'s way,
    without its thread: this process must stay single-threaded to fork)."""
    raw = os.environ.pop(lifeline.LAUNCHER_ENV, "")
    pdeath = os.environ.pop(lifeline.PDEATHSIG_ENV, "")
    if not raw.isdigit():
        return None
    if pdeath == "1":
        lifeline.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(raw):  # died before the signal was asked for: it would never come
        sys.exit(1)
    return int(raw)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    p.add_argument("--fd", type=int, required=True, help="the control socket, inherited from the launcher")
    p.add_argument("--preload", default="", help="comma-separated modules to import before serving")
    # Unused here: it names the run on this process's command line, and so on its children's (forks
    # keep it), where `ps` and a test's search for a run's processes look.
    p.add_argument("--run-dir", default="")
    args = p.parse_args(argv)
    setup_logging("zygote")
    launcher = _tie_to_launcher()
    sock = socket.socket(fileno=args.fd)
    t0 = time.monotonic()
    refused = preload([m for m in args.preload.split(",") if m])
    if refused is not None:
        log.error("not serving: %s", refused)
        _send(sock, {"event": "refused", "reason": refused})
        sys.exit(3)
    _send(sock, {"event": "ready", "seconds": round(time.monotonic() - t0, 2)})
    log.info("ready", extra={"seconds": round(time.monotonic() - t0, 2), "modules": len(sys.modules)})
    try:
        req = serve(sock, launcher)
    except OSError as err:  # the control socket: the launcher is gone
        log.error("control socket broken; exiting", extra={"error": str(err)})
        req = None
    if req is not None:  # in a forked child: the zygote's frames are gone from here on
        run_child(req)


# -- the launcher's side -----------------------------------------------------------------------------


class ZygoteChild:
    """A process the zygote forked: `subprocess.Popen`'s pid, returncode, poll, wait, send_signal,
    terminate and kill. It leads its own process group, so `os.killpg(pid, ...)` reaches its children."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._zygote = zygote
        self._identity = lifeline.start_time(pid)  # a later process with this pid is not this one
        self._done = threading.Event()

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self._zygote.alive and lifeline.start_time(self.pid) != self._identity:
            self._exited(LOST_RETURNCODE)  # reaped by whoever inherited it: its status is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._done.wait(min(left, 0.1))  # short: a dead zygote sends no more news
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # As Popen: nothing once the exit is known. The zygote reaps before it reports, so for the
        # moment between the two a signal could reach a new process with this pid: pids are handed
        # out in order, which makes that a wrap-around of the whole pid space within milliseconds.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    child: ZygoteChild | None = None
    error: str | None = None


class Zygote:
    """The launcher's handle on a zygote process; `start` it, `wait_ready`, then `spawn`."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.refused: str | None = None  # why the zygote would not serve, if it said so
        self._sock = sock
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closed = threading.Event()  # the control socket reached EOF: no more replies or exits
        self._pending: dict[int, _Pending] = {}
        self._children: dict[int, ZygoteChild] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, *, python: str, env: dict[str, str], log_path: Path, preload: Sequence[str] = (),
              run_dir: Path | None = None) -> Zygote:
        """Start a zygote that imports `preload`; it runs in a session of its own (a Ctrl-C reaches
        the launcher only) and writes its log to `log_path`."""
        ours, theirs = socket.socketpair()
        args = [python, "-u", "-m", MODULE, "--fd", str(theirs.fileno()), "--preload", ",".join(preload)]
        if run_dir is not None:
            args += ["--run-dir", str(run_dir)]
        try:
            with log_path.open("ab") as out:
                proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                        pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return not self._closed.is_set() and self.proc.poll() is None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.alive

    def wait_ready(self, timeout: float) -> bool:
        """Whether the zygote is ready to spawn within `timeout` seconds; False at once once it is gone."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if not self.alive or time.monotonic() >= deadline:
                return False
        return self.alive

    def spawn(self, module: str, argv: Sequence[str], env: dict[str, str], log_path: Path,
              cwd: str | None = None) -> ZygoteChild:
        """Fork a child that runs `python -m module *argv` with environment `env`, output to `log_path`."""
        if not self.alive:
            raise ZygoteError(self.refused or "the zygote is not running")
        if not self._ready.is_set():
            raise ZygoteError("the zygote is not ready")
        slot = _Pending()
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._pending[rid] = slot
            req = SpawnRequest(rid, module, list(argv), dict(env), str(log_path), cwd)
            try:
                _send(self._sock, req.__dict__)
            except OSError as err:
                del self._pending[rid]
                raise ZygoteError(f"the zygote's control socket: {err}") from None
        if not slot.done.wait(REPLY_TIMEOUT_S):
            raise ZygoteError(f"the zygote did not answer within {REPLY_TIMEOUT_S:.0f}s")
        if slot.child is None:
            raise ZygoteError(slot.error or "the zygote stopped before it answered")
        return slot.child

    def _read(self) -> None:
        try:
            for line in self._sock.makefile("rb"):
                msg = json.loads(line)
                event = msg.get("event")
                if event == "ready":
                    self._ready.set()
                elif event == "refused":
                    self.refused = str(msg.get("reason"))
                elif event in ("spawned", "failed"):
                    with self._lock:
                        slot = self._pending.pop(msg["id"], None)
                    if slot is None:
                        continue
                    if event == "spawned":
                        # Registered here, before the next line is read: its exit cannot come first.
                        pid = int(msg["pid"])
                        slot.child = self._children[pid] = ZygoteChild(self, pid, [MODULE, str(pid)])
                    else:
                        slot.error = str(msg.get("error"))
                    slot.done.set()
                elif event == "exited":
                    child = self._children.pop(msg["pid"], None)
                    if child is not None:
                        child._exited(int(msg["returncode"]))
        except (OSError, ValueError) as err:
            log.warning("zygote control socket broken", extra={"error": f"{type(err).__name__}: {err}"})
        finally:
            self._closed.set()
            with self._lock:
                pending, self._pending = list(self._pending.values()), {}
            for slot in pending:
                slot.done.set()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the zygote (SIGKILL if it has not exited within `timeout`), and close the control
        socket. Children still running get SIGTERM from its death: stop them first."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        # A signal, not just the closed socket: a zygote still importing reads the socket only after.
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        self._sock.close()

    def kill(self) -> None:
        """SIGKILL the zygote at once; safe from a signal handler or any thread."""
        if self.proc.returncode is None:
            with contextlib.suppress(OSError):
                self.proc.kill()


if __name__ == "__main__":
    main()
