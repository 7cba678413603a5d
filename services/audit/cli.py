"""`rlfleet audit` / `python -m services.audit`: print the report and exit 0 (every invariant
holds), 1 (a violation) or 2 (the run cannot be audited, one line on stderr)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.audit.limits import AuditError
from services.audit.report import EXIT_ERROR
from services.audit.run import audit


def audit_main(
    run_dir: Path,
    *,
    finished: bool | None = None,
    json_out: bool = False,
    limits: dict[str, Any] | None = None,
) -> int:
    """`rlfleet audit --run-dir DIR`: print the report (text, or JSON with `json_out`) to stdout
    and return the exit code: 0 all invariants hold, 1 a violation, 2 the run cannot be audited
    (the reason goes to stderr, or into the JSON as `error`)."""
    try:
        report = audit(Path(run_dir), finished=finished, limits=limits)
    except AuditError as err:
        if json_out:
            print(json.dumps({"run_dir": str(run_dir), "ok": False, "error": str(err)}, indent=2))
        print(f"rlfleet audit: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(report.to_dict(), indent=2) if json_out else report.render())
    return report.exit_code


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `rlfleet audit`."""
    p.add_argument("--run-dir", required=True)
    p.add_argument("--json", action="store_true")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--finished", action="store_true", help="treat the run as finished (in-flight tasks are lost)")
    g.add_argument("--running", action="store_true", help="treat the run as still going")


def run_args(args: argparse.Namespace) -> int:
    finished = True if args.finished else False if args.running else None
    return audit_main(Path(args.run_dir), finished=finished, json_out=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.audit", description="check a run against the five invariants of the task journal"
    )
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return run_args(args)
