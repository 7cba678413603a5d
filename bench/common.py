"""What every benchmark script shares: its timestamped progress line and the reading of a run's
JSON-lines file (`metrics.jsonl`) while the run may still be writing it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def say(*parts: Any, tag: str = "", err: bool = False) -> None:
    """One progress line, `[TAG HH:MM:SS] parts...` (`[HH:MM:SS]` without a tag), flushed at once to
    stdout, or to stderr with `err` (scripts whose stdout is their result). A script binds its own:
    `say = functools.partial(common.say, tag="learn", err=True)`."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{tag} {stamp}]" if tag else f"[{stamp}]", *parts, file=sys.stderr if err else sys.stdout, flush=True)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file, none where it does not exist yet; a line that does not parse (the
    one being written) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a row being written
    return rows
