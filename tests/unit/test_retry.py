"""The shared retry policy (services/core/retry.py): what it retries, how long, and how it stops."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.core.retry import Policy, grpc_codes


class Away(ConnectionError):
    pass


def flaky(fails: int, err: BaseException) -> tuple[list[int], object]:
    calls: list[int] = []

    async def op() -> str:
        calls.append(1)
        if len(calls) <= fails:
            raise err
        return "ok"

    return calls, op


def test_retries_a_listed_failure_until_it_succeeds() -> None:
    calls, op = flaky(3, Away("redis down"))
    seen: list[BaseException] = []
    out = asyncio.run(Policy(retry_on=(Away,), initial_s=0.001, max_s=0.002).call(
        op, what="test", on_retry=seen.append))  # type: ignore[arg-type]
    assert out == "ok" and len(calls) == 4 and len(seen) == 3


def test_an_unlisted_failure_raises_at_once() -> None:
    calls, op = flaky(3, KeyError("bug"))
    with pytest.raises(KeyError):
        asyncio.run(Policy(retry_on=(Away,), initial_s=0.001).call(op, what="test"))  # type: ignore[arg-type]
    assert len(calls) == 1


def test_the_deadline_reraises_the_last_failure() -> None:
    calls, op = flaky(10**6, Away("still down"))
    t0 = time.monotonic()
    with pytest.raises(Away, match="still down"):
        asyncio.run(Policy(retry_on=(Away,), initial_s=0.01, max_s=0.02, deadline_s=0.2).call(
            op, what="test"))  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - t0 < 2.0 and len(calls) > 2


def test_a_stop_event_cuts_the_backoff_short() -> None:
    calls, op = flaky(10**6, Away("down"))

    async def go() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, stop.set)
        await Policy(retry_on=(Away,), initial_s=30.0, max_s=30.0).call(op, what="test", stop=stop)  # type: ignore[arg-type]

    t0 = time.monotonic()
    with pytest.raises(Away):
        asyncio.run(go())
    # One attempt, the cut-short wait, one last attempt that sees the stop: never the 30 s waits.
    assert time.monotonic() - t0 < 5.0 and len(calls) == 2


def test_grpc_codes_matches_only_the_named_codes() -> None:
    def err(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

    pred = grpc_codes(grpc.StatusCode.UNAVAILABLE)
    assert pred(err(grpc.StatusCode.UNAVAILABLE))
    assert not pred(err(grpc.StatusCode.FAILED_PRECONDITION))
    assert not pred(Away("not grpc"))


def test_a_lambda_returning_a_coroutine_is_awaited_and_retried() -> None:
    calls, op = flaky(2, Away("down"))
    out = asyncio.run(Policy(retry_on=(Away,), initial_s=0.001).call(lambda: op(), what="test"))  # type: ignore[operator]
    assert out == "ok" and len(calls) == 3
