"""An engine in its own process logs into its service's log: a spawned child starts with logging
unconfigured, and its records (how long the engine took to start, weight loads, why it gave up) were
dropped. Real transformers engine in a real child process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from services.core.observability.logs import setup_logging
from services.models.engines.proc import ProcessEngine

# A real engine process, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180), pytest.mark.shares_host]


def test_the_engine_process_writes_its_records_as_json_lines_of_its_service(
    random_model: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    setup_logging("actor")
    try:
        engine = ProcessEngine("transformers", random_model, threads=1)
        engine.close()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    rows = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    child = [r for r in rows if r["service"] == "actor.engine"]
    assert any(r["msg"].startswith("transformers engine:") for r in child), rows
    assert all(r["level"] in ("info", "warning", "error") and "ts" in r for r in child)
    # The parent's own line, with the seconds the child took to come up, is still the actor's.
    started = [r for r in rows if r["msg"] == "engine process started"]
    assert started and started[0]["service"] == "actor" and started[0]["seconds"] > 0
