"""Structured JSON-lines logging shared by every service.

One line per record on stderr: ``{"ts", "level", "service", "logger", "msg", ...extra}``, so
`docker logs`, `kubectl logs` and `jq` read them without a parser of their own.

Rules for callers (the filter below enforces what it can):

* Log sizes, counts and ids (`task_id`, `version`, `nbytes`), **never payloads**: no prompt or
  completion text, no tensor data, no message bytes. A `bytes` value passed in `extra=` is logged
  as ``"<N bytes>"``, an array-like as its type, shape and dtype, and long strings are cut.
* Secrets never reach the output: values under keys that name a secret (token, password, secret,
  authorization, api key, cookie, credentials) are replaced by ``"***"``, and the message text is
  scrubbed of ``Bearer ...``, ``password=...`` and ``scheme://user:pass@`` forms.

Use ``log.info("trained step", extra={"step": 3, "samples": 128})``; extra keys become fields.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

REDACTED = "***"
# A string field longer than this is cut: a long string in a log line is almost always a payload
# (a prompt, a completion, a serialized message) that slipped through.
MAX_STR_CHARS = 1024

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}

# Key parts that name a secret wherever they appear in a key (`redis_password`, `x-api-key`).
_SECRET_PARTS = frozenset({"password", "passwd", "pwd", "secret", "authorization", "apikey", "cookie", "credentials"})
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")


def is_secret_key(key: str) -> bool:
    """True when a field named `key` holds a secret.

    `token` counts only as the last word of the key (`token`, `auth_token`, `access_token`): in this
    project `tokens`, `num_tokens` and `token_count` are counts of LLM tokens and must stay visible.
    """
    parts = [p for p in _WORD_SPLIT.split(key.lower()) if p]
    if not parts:
        return False
    joined = "".join(parts)
    if "apikey" in joined or "password" in joined or "secret" in joined:
        return True
    return parts[-1] == "token" or any(p in _SECRET_PARTS for p in parts)


_TEXT_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # `Authorization: Bearer abc.def`, `bearer abc`
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+"), r"\1\2" + REDACTED),
    # `password=hunter2`, `token: abc`, `"secret": "abc"`, `api_key=...`
    (
        re.compile(
            r"(?i)\b([A-Za-z0-9_-]*(?:token|password|passwd|secret|api[_-]?key|authorization))"
            r"(\"?'?\s*[=:]\s*\"?'?)(?!\s*\*\*\*)([^\s\"',;&}]+)"
        ),
        r"\1\2" + REDACTED,
    ),
    # `redis://:pw@host`, `https://user:pw@host`
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):[^@\s/]+@"), r"\1:" + REDACTED + "@"),
)


def redact_text(text: str) -> str:
    """Scrub secret-looking substrings from free text (messages, exception strings)."""
    for pattern, repl in _TEXT_PATTERNS:
        text = pattern.sub(repl, text)
    return text


def safe_value(value: Any, depth: int = 0) -> Any:
    """A JSON-safe, payload-free, secret-free version of a field value."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    if isinstance(value, str):
        value = redact_text(value)
        if len(value) > MAX_STR_CHARS:
            return value[:MAX_STR_CHARS] + f"...<{len(value) - MAX_STR_CHARS} more chars>"
        return value
    if depth >= 4:
        return f"<{type(value).__name__}>"
    if isinstance(value, Mapping):
        return {str(k): REDACTED if is_secret_key(str(k)) else safe_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        out = [safe_value(v, depth + 1) for v in items[:32]]
        if len(items) > 32:
            out.append(f"<{len(items) - 32} more>")
        return out
    shape = getattr(value, "shape", None)
    if shape is not None:
        # Tensors and arrays: never their data, only what identifies them.
        return f"<{type(value).__name__} shape={tuple(shape)} dtype={getattr(value, 'dtype', '?')}>"
    return redact_text(f"<{type(value).__name__}>" if _is_container_like(value) else str(value))[:MAX_STR_CHARS]


def _is_container_like(value: Any) -> bool:
    # Objects whose str() could dump their content (protobuf messages, dataclasses full of data).
    return hasattr(value, "SerializeToString") or hasattr(value, "__dataclass_fields__")


class RedactingFilter(logging.Filter):
    """Rewrites records in place so no formatter or handler downstream sees a secret or a payload.

    Installed on the handler (not a logger) so it also covers records propagated from library loggers
    (uvicorn, grpc, redis).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not lose the record
            message = f"{record.msg!r} (unformattable args)"
        record.msg = safe_value(message) if isinstance(message, str) else str(message)
        record.args = None
        for key, value in list(vars(record).items()):
            if key in _RECORD_ATTRS:
                continue
            setattr(record, key, REDACTED if is_secret_key(key) else safe_value(value))
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            # Tracebacks can quote locals' reprs in exception messages; scrub them too.
            out["exc"] = redact_text(self.formatException(record.exc_info))
        return json.dumps(out, default=str, ensure_ascii=False)


class _DiskTolerantHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A full disk under the log file costs log records, never the service, and prints no
    traceback per record onto the same full disk. Records whose write failed are counted; the next
    record that gets written is preceded by a note with that count (the stream's buffer may still
    have written some of them: the count is an upper bound of what was lost)."""

    dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.dropped:
            lost, self.dropped = self.dropped, 0
            note = logging.LogRecord(record.name, logging.WARNING, __file__, 0,
                                     "log records may be lost: the disk was full", None, None)
            note.failed_writes = lost
            super().emit(note)
            if self.dropped:  # still full: it was the note that got dropped, not a record
                self.dropped = lost
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        err = sys.exc_info()[1]
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            self.dropped += 1
            return
        super().handleError(record)


def current_service() -> str | None:
    """The service name `setup_logging` installed in this process, if it ran."""
    for h in logging.getLogger().handlers:
        if getattr(h, "_rlfleet", False) and isinstance(h.formatter, JsonFormatter):
            return h.formatter.service
    return None


def log_to_file(path: Path, service: str, logger: str = "rlfleet", level: int = logging.INFO) -> logging.Handler:
    """Also write `logger`'s records at `level` and above as JSON lines to `path`, redacted like the
    services' own: the launcher's log, next to the services' logs in RUN_DIR/logs. The logger is
    lowered to `level` if needed, so a console handler on the root must carry its own threshold."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _DiskTolerantHandler(path.open("a", buffering=1))
    handler.addFilter(RedactingFilter())
    handler.setFormatter(JsonFormatter(service))
    handler.setLevel(level)
    lg = logging.getLogger(logger)
    lg.addHandler(handler)
    if lg.getEffectiveLevel() > level:
        lg.setLevel(level)
    return handler


def setup_logging(service: str, level: str | int = "INFO", stream: IO[str] | None = None) -> logging.Logger:
    """Route all logging (ours and libraries') to one JSON-lines handler; return the service logger.

    Idempotent: calling it again replaces the handler it installed before.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_rlfleet", False):
            root.removeHandler(h)
    handler = _DiskTolerantHandler(stream or sys.stderr)
    handler._rlfleet = True  # type: ignore[attr-defined]
    handler.addFilter(RedactingFilter())
    handler.setFormatter(JsonFormatter(service))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # uvicorn installs its own handlers unless told not to; make its loggers propagate to ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    return logging.getLogger(f"rlfleet.{service}")
