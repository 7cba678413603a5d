"""Pieces of a service process's shell that are not its lifecycle: uvicorn embedded without its own
signal handling, the watchdog that hard-exits a hung shutdown, binding sockets ourselves, and the
state file `rlfleet status` reads."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn

log = logging.getLogger("rlfleet.runtime")


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the runtime owns SIGTERM/SIGINT so that a signal
    drains the whole service (gRPC, main loop, HTTP) in order instead of just stopping HTTP."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Watchdog:
    """Hard-exits the process if a shutdown step hangs (a stuck thread, a wedged driver call).

    A service that is neither serving nor gone is the worst state for a supervisor: it is never
    restarted. So every shutdown path arms one of these first.
    """

    def __init__(self, after_s: float, code: int, why: str) -> None:
        self._timer = threading.Timer(after_s, self._fire, args=(code, why))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _fire(code: int, why: str) -> None:
        log.error("shutdown hung, exiting hard", extra={"why": why, "exit_code": code})
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        os._exit(code)

    def cancel(self) -> None:
        self._timer.cancel()


def bind_tcp(host: str, port: int) -> socket.socket:
    """Bind (not listen) a TCP socket; port 0 picks a free one. uvicorn listens on it.

    Binding ourselves, rather than letting uvicorn do it, gives the real port before serving and a
    clear error (instead of uvicorn's sys.exit) when the port is taken.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Rebinding a port in TIME_WAIT after a restart; Linux still refuses a port that is in use.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def write_state_file(path: Path, record: dict[str, Any]) -> None:
    """Write-then-rename, so `rlfleet status` never reads a half-written file. A full disk only
    costs the file's freshness: it is a convenience and must not kill the service."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write state file", extra={"path": str(path), "error": str(e)})
        with contextlib.suppress(OSError):
            tmp.unlink()
