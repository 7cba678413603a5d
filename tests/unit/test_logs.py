from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from services.core.observability.logs import REDACTED, is_secret_key, redact_text, setup_logging


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    buf = io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    log = setup_logging("actor", "DEBUG", stream=buf)
    try:
        yield log, buf
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_each_record_is_one_json_line_with_the_standard_fields_and_extras(
    capture: tuple[logging.Logger, io.StringIO],
) -> None:
    log, buf = capture
    log.info("trained step %d", 3, extra={"step": 3, "samples": 128, "tokens": 4096})
    (rec,) = lines(buf)
    assert rec["msg"] == "trained step 3"
    assert rec["level"] == "info"
    assert rec["service"] == "actor"
    assert str(rec["ts"]).endswith("Z")
    # `tokens` here is a count of LLM tokens, not a secret: it must stay visible.
    assert (rec["step"], rec["samples"], rec["tokens"]) == (3, 128, 4096)


def test_secret_fields_are_redacted_whatever_their_nesting(
    capture: tuple[logging.Logger, io.StringIO],
) -> None:
    log, buf = capture
    log.warning(
        "connecting",
        extra={
            "token": "s3cr3t-token",
            "redis_password": "hunter2",
            "headers": {"Authorization": "Bearer abc.def", "x-request-id": "r1"},
            "client_secret": "shh",
            "auth_token": "t0k",
            "num_tokens": 12,
        },
    )
    (rec,) = lines(buf)
    assert rec["token"] == REDACTED
    assert rec["redis_password"] == REDACTED
    assert rec["client_secret"] == REDACTED
    assert rec["auth_token"] == REDACTED
    assert rec["headers"] == {"Authorization": REDACTED, "x-request-id": "r1"}
    assert rec["num_tokens"] == 12
    raw = buf.getvalue()
    for secret in ("s3cr3t-token", "hunter2", "abc.def", "shh", "t0k"):
        assert secret not in raw


def test_secrets_inside_message_text_and_tracebacks_are_scrubbed(
    capture: tuple[logging.Logger, io.StringIO],
) -> None:
    log, buf = capture
    log.info("calling with Authorization: Bearer abc123 and password=hunter2")
    log.info("redis at %s", "redis://:pw0rd@10.0.0.5:6379/0")
    try:
        raise RuntimeError("login failed token=deadbeef")
    except RuntimeError:
        log.exception("boom")
    raw = buf.getvalue()
    for secret in ("abc123", "hunter2", "pw0rd", "deadbeef"):
        assert secret not in raw
    recs = lines(buf)
    assert "10.0.0.5:6379" in str(recs[1]["msg"])
    assert "RuntimeError" in str(recs[2]["exc"])


def test_payloads_are_logged_as_sizes_never_bytes(capture: tuple[logging.Logger, io.StringIO]) -> None:
    log, buf = capture

    class FakeTensor:
        shape = (2, 3)
        dtype = "float32"

    log.info("published", extra={"body": b"\x00" * 5000, "logits": FakeTensor(), "text": "x" * 10_000})
    (rec,) = lines(buf)
    assert rec["body"] == "<5000 bytes>"
    assert rec["logits"] == "<FakeTensor shape=(2, 3) dtype=float32>"
    assert len(str(rec["text"])) < 1200


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("token", True),
        ("access_token", True),
        ("Authorization", True),
        ("x-api-key", True),
        ("REDIS_PASSWORD", True),
        ("tokens", False),
        ("max_tokens", False),
        ("token_count", False),
        ("task_id", False),
    ],
)
def test_secret_key_names(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_redact_text_keeps_ordinary_text() -> None:
    text = "generated 128 tokens for task 7 in 0.3s (max_tokens=256)"
    assert redact_text(text) == text


def test_setup_logging_is_idempotent(capture: tuple[logging.Logger, io.StringIO]) -> None:
    _, buf = capture
    buf2 = io.StringIO()
    log = setup_logging("actor", "INFO", stream=buf2)
    log.info("once")
    assert len(lines(buf2)) == 1
    assert buf.getvalue() == ""
