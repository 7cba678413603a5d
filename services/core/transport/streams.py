"""What travels on the bus, and the names it travels under: stream keys, delivered messages, the
bus's errors, the entry encoding (a `data` field plus a few routing headers) and how a Redis error
is classified (an outage to wait out, or a refusal to report).

`services.core.transport.bus` is the only user; it re-exports the public names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from redis import exceptions as rexc
from redis.typing import EncodableT, FieldT

# Records keep the bus's logger name: operators filter on it.
log = logging.getLogger("services.core.transport.bus")

DATA_FIELD: Final = "data"
# Header fields copied into a dead-letter record are prefixed so they cannot shadow its own fields.
DEAD_HEADER_PREFIX: Final = "h."
# Headers are routing metadata (kind, task_count, batch_id, schema), not a second payload channel.
MAX_HEADERS: Final = 16
MAX_HEADER_VALUE_CHARS: Final = 512
MAX_REASON_CHARS: Final = 2000

_RUN_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Stage and group names end up inside Redis key and consumer-group names, so no ':'; consumer
# names may carry host:pid.
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
CONSUMER_RE: Final = re.compile(r"^[A-Za-z0-9_.:@-]{1,200}$")
_HEADER_RE: Final = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_MAX_SEQ: Final = 2**64 - 1


# -- errors ------------------------------------------------------------------------------------
class BusError(Exception):
    """A bus operation that cannot succeed as asked (not a connectivity problem)."""


class BusUnavailable(ConnectionError):
    """Redis is unreachable (down, restarting, refusing, out of memory); retry later.

    The message names host:port and never the password."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class MessageTooLarge(BusError, ValueError):
    """A payload over `flow.max_message_bytes`; rejected before anything is sent."""


# -- names -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamKeys:
    """Redis key names for one run; the only place that spells them."""

    run: str

    def __post_init__(self) -> None:
        if not _RUN_RE.match(self.run):
            raise ValueError(f"run name must match {_RUN_RE.pattern}, got {self.run!r}")

    @property
    def prefix(self) -> str:
        return f"rlfleet:{self.run}"

    @property
    def prompts(self) -> str:
        return f"{self.prefix}:prompts"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def scores(self) -> str:
        return f"{self.prefix}:scores"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def streams(self) -> dict[str, str]:
        """Short name -> stream key, for metrics labels."""
        return {"prompts": self.prompts, "rollouts": self.rollouts, "scores": self.scores, "dead": self.dead}


@dataclass(frozen=True)
class Message:
    """One delivered stream entry. `deliveries` counts this delivery (1 on first read)."""

    stream: str
    id: str
    data: bytes
    headers: dict[str, str]
    deliveries: int


# -- helpers -----------------------------------------------------------------------------------
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


def log_event(level: int, event: str, **fields: object) -> None:
    """One structured record: the event name as the message, ids and counts as `extra` fields
    (the project's JSON formatter turns them into keys). Never pass payloads here."""
    if log.isEnabledFor(level):
        # A field named like a LogRecord attribute would make logging raise; suffix it instead.
        extra = {(f"{k}_" if k in _RECORD_ATTRS else k): v for k, v in fields.items() if v is not None}
        log.log(level, event, extra=extra)


def as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def check_name(kind: str, name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(f"{kind} name must match {_NAME_RE.pattern}, got {name!r}")


def endpoint_from_url(url: str) -> str:
    """host:port of a redis:// URL, for error messages (never the credentials)."""
    try:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return f"unix:{parts.path}"
        return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
    except ValueError:
        return "<unparsable redis url>"


def encode_headers(headers: Mapping[str, str]) -> dict[FieldT, EncodableT]:
    if len(headers) > MAX_HEADERS:
        raise ValueError(f"at most {MAX_HEADERS} headers, got {len(headers)}")
    out: dict[FieldT, EncodableT] = {}
    for name, value in headers.items():
        if not _HEADER_RE.match(name) or name == DATA_FIELD:
            raise ValueError(
                f"header name must match {_HEADER_RE.pattern} and not be '{DATA_FIELD}': {name!r}"
            )
        if not isinstance(value, str):
            raise TypeError(f"header {name!r} must be a str, got {type(value).__name__}")
        if len(value) > MAX_HEADER_VALUE_CHARS:
            raise ValueError(f"header {name!r} is {len(value)} characters, over {MAX_HEADER_VALUE_CHARS}")
        out[name.encode()] = value.encode()
    return out


def decode_headers_lenient(fields: Mapping[Any, Any] | None) -> dict[str, str]:
    """Headers for a dead-letter record: best effort, a bad byte must not stop dead-lettering."""
    out: dict[str, str] = {}
    for k, v in (fields or {}).items():
        name = bytes(k).decode("utf-8", "replace") if isinstance(k, bytes | bytearray) else str(k)
        if name != DATA_FIELD:
            out[name] = bytes(v).decode("utf-8", "replace")[:MAX_HEADER_VALUE_CHARS]
    return out


def entry_field(fields: Mapping[Any, Any], name: str) -> bytes | None:
    value = fields.get(name.encode(), fields.get(name))
    return None if value is None else bytes(value)


def stream_entries(resp: Any) -> Iterable[tuple[Any, Any]]:
    """Entries of a single-stream XREADGROUP reply (RESP2 shape: [[stream, entries]])."""
    return [entry for _stream, entries in resp or [] for entry in entries]


def parse_id(msg_id: str) -> tuple[int, int]:
    ms, _, seq = msg_id.partition("-")
    return int(ms), int(seq or 0)


def next_id(msg_id: tuple[int, int]) -> tuple[int, int]:
    ms, seq = msg_id
    return (ms + 1, 0) if seq >= _MAX_SEQ else (ms, seq + 1)


# Replies that mean "Redis cannot take this right now, and will again without anyone changing our
# request": out of memory, a failing disk (MISCONF: the AOF or RDB write failed, e.g. the disk is
# full), still loading its data, a replica that is read-only or lost its master, not enough
# replicas to accept writes. Callers treat them like a dropped connection: hold work and retry.
_OUTAGE_CODES: Final = {
    "OOM": "is out of memory (maxmemory)",
    "MISCONF": "cannot persist its data (MISCONF: is its disk full?)",
    "LOADING": "is loading its data",
    "READONLY": "is a read-only replica",
    "MASTERDOWN": "lost its master",
    "NOREPLICAS": "has too few replicas to accept writes",
    "BUSY": "is busy running a script",
    "TRYAGAIN": "asks to try again",
    "CLUSTERDOWN": "reports its cluster down",
}


def outage_reason(err: rexc.ResponseError) -> str | None:
    """Why Redis refused a command for a reason that passes by itself, or None for a real refusal.

    redis-py strips the code from the message of the errors it has a class for (OOM, READONLY...)
    and keeps it on `status_code`; the others (MISCONF, MASTERDOWN...) keep it in the message."""
    code = getattr(err, "status_code", None) or (str(err).split(" ", 1)[0] if str(err) else "")
    return _OUTAGE_CODES.get(str(code).upper())
