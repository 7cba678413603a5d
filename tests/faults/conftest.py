from __future__ import annotations

import json
import os
from typing import Any


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.faults.test_faults import RECOVERY

    if not RECOVERY:
        return
    terminalreporter.section("fault recovery (fault injected -> next step completed)")
    for name, seconds in RECOVERY:
        terminalreporter.write_line(f"{name:<55} {seconds:7.2f} s")
    out = os.environ.get("RLFLEET_FAULT_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump([{"case": n, "recovery_s": s} for n, s in RECOVERY], f, indent=2)
