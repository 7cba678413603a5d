"""`python -m bench.vs_trl` (see the package's docstring and `cli`)."""

import sys

from bench.vs_trl.cli import main

sys.exit(main())
