"""What the launcher says when a service dies: the last error of its log, on one line."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from services.core.logs import setup_logging
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
