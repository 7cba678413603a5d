"""An append-only JSONL event log: what happened, in order, for `rlfleet audit`.

One event per line: `{"ts": <unix seconds>, "kind": "<kind>", ...fields}`. The journal is the
source of truth for task state; this log is the history the audit replays to check the
invariants (every admitted task ends trained or dead, each counts once, staleness bounded,
versions monotonic, resources bounded).

Crash safety: a batch of events goes out in one `write` and is fsynced (unless `fsync=False`),
so after a crash the file ends with whole lines plus at most one torn line. The reader skips a
torn line; the writer cuts a torn tail off when it reopens the file (it was never acknowledged)
so new events do not get glued onto it, and cuts back its own partial write if a write fails so
the next one starts on a clean line.

A full disk (ENOSPC, EDQUOT) does not stop the writer: lines that cannot be written are held in
memory, in order, and go out with the next append (or `flush`) once space returns; `held_bytes`
says how much is waiting. `AppendOnlyFile` is that writer, for any JSON-lines file (the
controller's metrics.jsonl too).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Fields each kind must carry for the audit to check its invariant; extra fields are allowed.
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "admitted": ("task_ids", "cursor"),
    "generated": ("task_ids", "version"),
    "scored": ("task_ids",),
    "trained": ("step", "task_ids", "version", "generated_versions"),
    "checkpoint": ("service", "version", "step"),
    "version_served": ("service", "version"),
    "dead": ("task_id", "reason"),
    "dropped": ("task_ids", "reason", "step"),
    "resources": ("queue_depths", "rss_bytes", "disk_bytes"),
}
_RESERVED = ("ts", "kind")


@dataclass(frozen=True)
class Event:
    kind: str
    fields: dict[str, Any]
    ts: float = field(default_factory=time.time)

    def to_line(self) -> bytes:
        clash = [k for k in _RESERVED if k in self.fields]
        if clash:
            raise ValueError(f"event field names {clash} are reserved")
        return (
            json.dumps({"ts": self.ts, "kind": self.kind, **self.fields}, separators=(",", ":")).encode()
            + b"\n"
        )


def validate(event: Event) -> None:
    """Raise ValueError when `event` is not a known kind or lacks a field the audit needs."""
    need = EVENT_FIELDS.get(event.kind)
    if need is None:
        raise ValueError(f"unknown event kind {event.kind!r}; known: {sorted(EVENT_FIELDS)}")
    missing = [f for f in need if f not in event.fields]
    if missing:
        raise ValueError(f"{event.kind} event lacks fields {missing}")


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Held lines beyond this mean the disk has been full for very long; refusing then (OSError) is
# better than growing without bound.
MAX_HELD_BYTES = 256 << 20


class AppendOnlyFile:
    """Appends whole lines to `path`, one `write` (+ fsync) per call. Thread-safe; one writer
    process per file. On a full disk the data is held, in order, until space returns."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self.held_bytes = 0
        self._warned = False  # one warning per full-disk episode, not one per held line
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created and fsync:
            _fsync_dir(self.path.parent)  # the new file's directory entry must survive a crash too
        _cut_torn_tail(self._fd, self.path)

    def append(self, data: bytes) -> bool:
        """Append `data` (whole lines) after anything held; True when all of it is on disk, False
        when the disk is full and it is held. Other OS errors raise."""
        with self._lock:
            if self._fd is None:
                raise ValueError(f"{self.path} is closed")
            if data:
                if self.held_bytes + len(data) > MAX_HELD_BYTES:
                    raise OSError(errno.ENOSPC, f"{self.path}: disk full and {self.held_bytes} bytes already held")
                self._held.append(data)
                self.held_bytes += len(data)
            return self._write_held()

    def flush(self) -> bool:
        """Try to write what is held; True when nothing is held any more."""
        return self.append(b"")

    def _write_held(self) -> bool:
        assert self._fd is not None
        if not self._held:
            return True
        data = b"".join(self._held)
        # Where our write starts, read now rather than tracked: a second appender of the same
        # file (the controller's metrics back-fill) must not be cut off by a failed write here.
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                n = os.write(self._fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as err:
            # Cut our partial line so the next write starts clean; best effort, the reader
            # tolerates a torn line anyway.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            if err.errno not in _DISK_FULL:
                raise
            if not self._warned:
                log.warning("disk full; holding lines until space returns",
                            extra={"path": str(self.path), "held_bytes": self.held_bytes})
                self._warned = True
            self._held = [data]
            return False
        if self._warned:
            log.info("disk has space again; held lines written", extra={"path": str(self.path), "bytes": len(data)})
            self._warned = False
        self._held.clear()
        self.held_bytes = 0
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            if self._held:
                with contextlib.suppress(OSError):
                    self._write_held()
                if self._held:
                    log.error("closing with lines never written (disk full)",
                              extra={"path": str(self.path), "held_bytes": self.held_bytes})
            os.close(self._fd)
            self._fd = None


class EventLog:
    """Appends events to `path`. Thread-safe; one writer process per file."""

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: bool = True, validate_kinds: bool = True
    ) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.validate_kinds = validate_kinds
        self._file = AppendOnlyFile(self.path, fsync=fsync)

    @property
    def held_bytes(self) -> int:
        """Event bytes waiting for disk space (0 normally)."""
        return self._file.held_bytes

    def emit(self, kind: str, *, ts: float | None = None, **fields: Any) -> Event:
        """Append one event (one write, one fsync) and return it."""
        ev = Event(kind, fields) if ts is None else Event(kind, fields, ts)
        self.emit_many([ev])
        return ev

    def emit_many(self, events: Iterable[Event]) -> None:
        """Append `events` as one write followed by one fsync: the batch costs one disk flush.
        On a full disk they are held and written, in order, once space returns."""
        evs = list(events)
        if self.validate_kinds:
            for ev in evs:
                validate(ev)
        data = b"".join(ev.to_line() for ev in evs)
        if data:
            self._file.append(data)

    def flush(self) -> bool:
        return self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[Event]:
        """Every whole event in `path`, in order; a torn or unreadable line is skipped, never
        raised. A missing file reads as no events."""
        return list(iter_events(path))


def iter_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Every whole event in `path`, in order, logging what it skips (see `EventReader`)."""
    return iter(EventReader(path))


class EventReader:
    """The one parser of an event log: iterating yields every whole event in order, and leaves
    behind what was skipped, for a caller that reports it (`rlfleet audit`).

    Each iteration reads up to the file's size when it starts, so the counts stay consistent while
    a live writer appends. A final line without its newline is torn (a writer that died, or is,
    mid-write; never acknowledged): skipped and flagged in `torn`. A whole line that is not one
    JSON object with a numeric `ts` and a string `kind` is skipped and counted in `unreadable`.
    `quiet=True` logs nothing: for a caller that reports the counts itself."""

    def __init__(self, path: str | os.PathLike[str], *, quiet: bool = False) -> None:
        self.path = Path(path)
        self.quiet = quiet
        self.lines = 0  # whole lines read, readable or not
        self.unreadable = 0
        self.torn = False

    def __iter__(self) -> Iterator[Event]:
        self.lines, self.unreadable, self.torn = 0, 0, False
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            left = os.fstat(f.fileno()).st_size
            for raw in f:
                if left <= 0:
                    return
                raw = raw[:left]
                left -= len(raw)
                if not raw.endswith(b"\n"):
                    self.torn = True
                    if not self.quiet:
                        log.info(
                            "event log %s: skipping torn last line %d (%d bytes)", self.path, self.lines + 1, len(raw)
                        )
                    return
                self.lines += 1
                ev = _parse(raw)
                if ev is None:
                    self.unreadable += 1
                    if not self.quiet:
                        log.warning("event log %s: skipping unreadable line %d", self.path, self.lines)
                    continue
                yield ev


def _parse(raw: bytes) -> Event | None:
    try:
        d = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return None
    if not isinstance(d, dict):
        return None
    ts, kind = d.pop("ts", None), d.pop("kind", None)
    if not isinstance(kind, str) or not isinstance(ts, int | float) or isinstance(ts, bool) or ts != ts:
        return None  # ts != ts: NaN, which json.loads accepts, orders nothing
    return Event(kind, d, float(ts))


def _cut_torn_tail(fd: int, path: Path) -> int:
    """Truncate `fd` after its last newline; returns the resulting size."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    with path.open("rb") as f:
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                end = start + nl + 1
                break
            pos = start
        else:
            end = 0
    if end != size:
        log.warning("event log %s: cutting a torn tail of %d bytes left by a crash", path, size - end)
        os.ftruncate(fd, end)
    return end


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
