"""`CallGate`: the pause / abort / in-flight bookkeeping every generation engine keeps the same way.

One condition variable guards four facts: whether new calls may start (`pause`/`resume`), whether a
weight update holds the engine, how many calls are in flight, and the abort epoch. A call records
the epoch it started in; `abort()` bumps the epoch, so exactly the calls in flight at that moment
see `aborted(epoch)` and calls started afterwards do not (see the contract in `engine.py`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class CallGate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paused = False
        self._updating = False
        self._in_flight = 0
        self._epoch = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextlib.contextmanager
    def call(self) -> Iterator[int]:
        """One call of the engine: waits while paused or updating; yields the call's abort epoch."""
        with self._cv:
            self._cv.wait_for(lambda: not self._paused and not self._updating)
            self._in_flight += 1
            epoch = self._epoch
        try:
            yield epoch
        finally:
            with self._cv:
                self._in_flight -= 1
                self._cv.notify_all()

    def aborted(self, epoch: int) -> bool:
        """Whether `abort()` ran since the call that started in `epoch` began."""
        return self._epoch != epoch

    def abort(self) -> int:
        """Abort every call in flight now; returns the new epoch."""
        with self._cv:
            self._epoch += 1
            return self._epoch

    def pause(self) -> None:
        """Stop new calls from starting; returns once the calls in flight have finished."""
        with self._cv:
            self._paused = True
            self._cv.wait_for(lambda: self._in_flight == 0)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self, check: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold the engine alone (a weight update): one at a time, new calls wait, and the body starts
        once the calls in flight have finished. `check` runs first, under the lock (it may raise)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._updating)
            if check is not None:
                check()
            self._updating = True
            self._cv.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self._cv:
                self._updating = False
                self._cv.notify_all()
