"""`python -m bench.data_plane` (see the package's docstring and `cli`)."""

import sys

from bench.data_plane.cli import main

sys.exit(main())
