"""The client side of the fleet's gRPC: `make_channel` (message size limits both ways) and `rpc` (a
deadline on every call, retries only for idempotent calls, the token as metadata)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from services.core.transport.auth import AUTH_METADATA_KEY, bearer

log = logging.getLogger("rlfleet.runtime")


def grpc_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback_host(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


R = TypeVar("R")
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


# gRPC's reconnect backoff grows to 120 s by default: a channel that found its peer down while the peer
# started (the actor's vLLM engine takes a minute or two) kept failing for up to a minute after the peer
# was serving. On the H200 run of 2026-12-02 the controller reached a ready actor 25-61 s late, which
# was most of rlfleet's lag to its first step behind TRL's. Capped at a second, the evaluation before
# training still started 1-1.5 s after the actor was ready (CPU fleet logs, 2026-12-06): every start
# and every restart paid it. A connection attempt to a fleet peer that is down is one refused SYN, so
# a quarter second costs nothing and a restarted or hot-swapped peer is reached within about that.
RECONNECT_BACKOFF_MS = 250


def make_channel(
    host: str, port: int, max_message_bytes: int, *, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An insecure grpc.aio channel with the fleet's message size limits in both directions, which
    retries a peer that is down at least every `RECONNECT_BACKOFF_MS`."""
    return grpc.aio.insecure_channel(
        grpc_target(host, port),
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", min(100, RECONNECT_BACKOFF_MS)),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            *options,
        ],
    )


def _method_name(stub_method: Any) -> str:
    raw = getattr(stub_method, "_method", None)
    if isinstance(raw, bytes):
        return raw.decode(errors="replace")
    return str(raw) if raw is not None else type(stub_method).__name__


async def rpc(
    stub_method: Callable[..., Awaitable[R]],
    request: Any,
    *,
    timeout_s: float,
    idempotent: bool,
    retries: int = 3,
    token: str | None = None,
    metadata: Sequence[tuple[str, str]] = (),
    backoff_s: float = 0.2,
    max_backoff_s: float = 5.0,
) -> R:
    """Call a unary gRPC method with a deadline; retry only what is safe to repeat.

    Each attempt has its own `timeout_s` deadline. Idempotent calls (GetState, a Train keyed by step
    that the server deduplicates) are retried up to `retries` more times on UNAVAILABLE and
    DEADLINE_EXCEEDED, with jittered exponential backoff. A non-idempotent call is never retried: a
    DEADLINE_EXCEEDED does not say whether the server applied it. Other codes raise at once.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    md = list(metadata)
    if token:
        md.append((AUTH_METADATA_KEY, bearer(token)))
    attempts = 1 + (max(0, retries) if idempotent else 0)
    for attempt in range(attempts):
        try:
            return await stub_method(request, timeout=timeout_s, metadata=tuple(md) or None)
        except grpc.aio.AioRpcError as e:
            if attempt + 1 >= attempts or e.code() not in RETRYABLE_CODES:
                raise
            # Jitter keeps replicas that lost the same peer from retrying in lockstep.
            delay = min(max_backoff_s, backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning(
                "rpc failed, retrying",
                extra={
                    "method": _method_name(stub_method),
                    "code": e.code().name,
                    "attempt": attempt + 1,
                    "of": attempts,
                    "delay_s": round(delay, 3),
                },
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises
