import sys

from services.audit.cli import main

sys.exit(main())
