"""Journal writes that must happen: retried while the disk is full, never skipped, never half-done
(each write is one LMDB transaction). While one waits, the controller reports not ready."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from services.core.journal.journal import Journal, JournalFull
from services.core.retry import Policy

log = logging.getLogger("rlfleet.controller")

T = TypeVar("T")

# A full disk heals when an operator frees space: wait for as long as it takes, checking every few seconds.
UNTIL_SPACE = Policy(retry_on=(JournalFull,), initial_s=0.5, max_s=5.0)


class DurableJournal:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.error: str | None = None  # the last write failure, until a write succeeds

    def failed(self, err: BaseException) -> None:
        self.error = str(err)[:300]

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        out = await UNTIL_SPACE.call(lambda: asyncio.to_thread(fn, *args), what="journal write",
                                     on_retry=self.failed, log_level=logging.ERROR)
        self.error = None
        return out
