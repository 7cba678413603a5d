"""What tests/unit/test_zygote.py forks: `python -m tests.unit.zygote_child CODE` runs CODE, so each test
says in one line what its child does (exit, sleep, report its environment or descriptors)."""

import sys

exec(sys.argv[1])
