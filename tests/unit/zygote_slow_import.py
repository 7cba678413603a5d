"""A module whose import takes a minute: a zygote preloading it is one still importing (tests/unit/test_zygote.py)."""

import time

time.sleep(60)
