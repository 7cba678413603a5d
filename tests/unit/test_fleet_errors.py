"""What the launcher says when a service dies: the last error of its log, on one line."""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.core.observability.logs import setup_logging
from services.fleet import last_error


def test_the_last_logged_error_is_one_line_with_the_exception_and_the_log_keeps_the_traceback(tmp_path: Path) -> None:
    buf = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging("reward", stream=buf)
    try:
        log = logging.getLogger("rlfleet")
        log.info("loading")
        log.error("first failure")
        try:
            raise OSError("cannot bind gRPC on 127.0.0.1:5: address in use")
        except OSError:
            log.error("start-up failed", exc_info=True)
        log.info("draining")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    path = tmp_path / "reward.log"
    path.write_text(buf.getvalue())
    assert last_error(path) == "start-up failed: OSError: cannot bind gRPC on 127.0.0.1:5: address in use"
    assert "Traceback" in path.read_text()


def test_a_service_that_died_before_logging_reports_its_last_printed_line(tmp_path: Path) -> None:
    path = tmp_path / "actor.log"
    path.write_text('Traceback (most recent call last):\n  File "x.py", line 1\nImportError: no module named vllm\n\n')
    assert last_error(path) == "ImportError: no module named vllm"
    assert last_error(tmp_path / "missing.log") == "no log written"


def test_a_stop_signal_that_lands_in_a_finalizer_prints_nothing_and_still_stops_the_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen in `rlfleet up`: SIGTERM while the garbage collector ran a `regex` object's __del__. Python
    # can only hand the Interrupted raised there to sys.unraisablehook, whose default prints "Exception
    # ignored in ... Traceback" on stderr; the launcher must say its one line, and still stop at its
    # next step. Other unraisable errors still reach the hook that was installed before.
    from services.core.config.run import parse_config
    from services.fleet import Fleet, Interrupted

    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    # The signal arms the launcher's watchdog, which os._exit()s its process HARD_EXIT_S later: here
    # that is the test runner's worker, killed minutes later in the middle of another test.
    armed: list[int] = []
    monkeypatch.setattr(Fleet, "_watchdog", lambda self, signum: armed.append(signum))
    fleet = Fleet(parse_config({"run": {"dir": str(tmp_path / "run")}}, source="test"))

    class SignalledWhileCollected:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, inside the finalizer

    class FailsWhileCollected:
        def __del__(self) -> None:
            raise ValueError("not a signal")

    before = signal.getsignal(signal.SIGTERM)
    with fleet.stop_on_signals():
        obj: object = SignalledWhileCollected()
        del obj
        assert fleet.stop_signal == signal.SIGTERM and seen == []
        with pytest.raises(Interrupted):
            fleet.check_stop()
        obj = FailsWhileCollected()
        del obj
    assert [type(e) for e in seen] == [ValueError]
    assert armed == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == before
