"""The stream worker's delivery rules against a real redis-server: content errors are dead-lettered
with a reason and the loop goes on, bugs still fail fast with the message left pending, and "not
now" failures are retried in place by the one backoff policy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from services.core.host.redis_proc import RedisProcess
from services.core.observability.metrics import ServiceMetrics
from services.core.serving.worker import StreamWorker
from services.core.transport.bus import Bus, BusUnavailable, Message

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = pytest.mark.shares_host


def run_worker(rp: RedisProcess, payloads: list[bytes],
               handle: Callable[[StreamWorker, Message], Awaitable[None]], count: int = 1,
               together: bool = False, gate: Callable[[], Awaitable[int | None]] | None = None) -> BaseException | None:
    async def main() -> BaseException | None:
        bus = await Bus.connect(rp.url, "w")
        stream = bus.keys.prompts
        await bus.ensure_groups(stream, ["g"])
        for i, data in enumerate(payloads):
            await bus.publish(stream, data, kind="prompts", batch_id=f"b{i}")
        worker = StreamWorker(bus, stream, "g", "c1", lambda m: handle(worker, m), ServiceMetrics("t"),
                              block_ms=100, count=count, together=together, gate=gate)
        try:
            await asyncio.wait_for(worker.run(), 30)
        except Exception as err:  # what the service's main loop would die of
            return err
        finally:
            await bus.close()
        return None

    return asyncio.run(main())


def test_a_value_error_from_a_message_is_dead_lettered_and_the_loop_goes_on(redis_server: RedisProcess) -> None:
    seen: list[bytes] = []

    async def handle(w: StreamWorker, msg: Message) -> None:
        if msg.data == b"bad":
            raise ValueError("temperature must be >= 0 (0 = greedy), got -1.0")  # what SamplingParams raises
        seen.append(msg.data)
        w.stop()

    err = run_worker(redis_server, [b"bad", b"good"], handle)
    assert err is None and seen == [b"good"]
    r = redis_server.client()
    dead = [f for _, f in r.xrange("rlfleet:w:dead")]
    assert [d[b"reason"] for d in dead] == [b"invalid_content: temperature must be >= 0 (0 = greedy), got -1.0"]
    assert r.xpending("rlfleet:w:prompts", "g")["pending"] == 0


@pytest.mark.parametrize("payloads", [[b"bug"], [b"a", b"bug", b"c"]], ids=["alone", "handled-together"])
def test_a_bug_in_the_handler_fails_fast_and_leaves_its_messages_pending(redis_server: RedisProcess,
                                                                         payloads: list[bytes]) -> None:
    async def handle(w: StreamWorker, msg: Message) -> None:
        if msg.data == b"bug":
            raise RuntimeError("a bug")
        await asyncio.sleep(30)  # still running when the bug ends the loop: cancelled, not acknowledged

    err = run_worker(redis_server, payloads, handle, count=len(payloads), together=len(payloads) > 1)
    assert isinstance(err, RuntimeError)
    r = redis_server.client()
    assert r.xlen("rlfleet:w:dead") == 0
    assert r.xpending("rlfleet:w:prompts", "g")["pending"] == len(payloads)


def test_a_transient_failure_is_retried_in_place_then_acknowledged(redis_server: RedisProcess) -> None:
    calls: list[bool] = []

    async def handle(w: StreamWorker, msg: Message) -> None:
        calls.append(w.redis_ok)
        if len(calls) < 3:
            raise BusUnavailable("127.0.0.1:1", "connection refused")
        w.stop()

    err = run_worker(redis_server, [b"x"], handle)
    assert err is None
    # Each failure was seen (redis marked unreachable) and the message handled once it passed.
    assert calls == [True, False, False]
    r = redis_server.client()
    assert r.xlen("rlfleet:w:dead") == 0
    assert r.xpending("rlfleet:w:prompts", "g")["pending"] == 0


def test_messages_read_together_are_handled_side_by_side_each_acked_or_dead_lettered_alone(
    redis_server: RedisProcess,
) -> None:
    started: list[bytes] = []
    together = asyncio.Event()

    async def handle(w: StreamWorker, msg: Message) -> None:
        started.append(msg.data)
        if len(started) == 3:
            together.set()
        await asyncio.wait_for(together.wait(), 5)  # only returns if all three run at once
        if msg.data == b"bad":
            raise ValueError("temperature must be >= 0 (0 = greedy), got -1.0")
        w.stop()

    err = run_worker(redis_server, [b"a", b"bad", b"c"], handle, count=3, together=True)
    assert err is None and sorted(started) == [b"a", b"bad", b"c"]
    r = redis_server.client()
    assert [f[b"reason"] for _, f in r.xrange("rlfleet:w:dead")] == [
        b"invalid_content: temperature must be >= 0 (0 = greedy), got -1.0"]
    assert r.xpending("rlfleet:w:prompts", "g")["pending"] == 0


def test_a_gate_bounds_how_many_messages_one_read_takes(redis_server: RedisProcess) -> None:
    in_flight: list[int] = []

    async def room() -> int:
        return 2  # what backpressure lets through below its high watermark

    async def handle(w: StreamWorker, msg: Message) -> None:
        await asyncio.sleep(0.05)  # the messages of one read are all in flight by now
        in_flight.append(w.in_flight)
        if len(in_flight) == 3:
            w.stop()

    err = run_worker(redis_server, [b"a", b"b", b"c"], handle, count=8, together=True, gate=room)
    assert err is None and in_flight == [2, 2, 1]
