"""The `rlfleet` console script.

Kept apart from `services.cli` because that module's own imports take half a second from a cold
cache, and a Ctrl-C landing in them would otherwise end in a traceback and death by SIGINT instead
of the one line and exit 130 the rest of the command gives.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from services import cli

        return cli.main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
