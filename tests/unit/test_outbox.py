"""The actor's LMDB outbox against a real redis-server: puts while Redis is down survive a reopen,
flush delivers in order once Redis is back, stops at BusUnavailable keeping the rest, and kill -9
mid-flush loses nothing (at-least-once: a duplicate, never a gap). Plus growth and full disks.

No pytest-asyncio: coroutines run under `arun`, bounded in time; every wait is a bounded poll."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.actor.outbox import Outbox, OutboxEntry, OutboxError, OutboxFull, Publish
from services.core.host.redis_proc import RedisProcess, start_redis
from services.core.transport.bus import Bus, BusUnavailable, StreamKeys

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
RUN = "outboxtest"
STREAM = StreamKeys(RUN).rollouts
KiB = 1024


def arun(coro: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def payload(i: int) -> bytes:
    return f"batch-{i}:".encode() + bytes([i % 251]) * (100 + i)


def headers(i: int) -> dict[str, str]:
    return {"kind": "rollout", "batch_id": f"b{i}"}


def publisher(bus: Bus) -> Publish:
    async def publish(stream: str, data: bytes, hdrs: dict[str, str]) -> str:
        return await bus.publish(stream, data, **hdrs)

    return publish


def stream_batches(rp: RedisProcess) -> list[tuple[str, bytes]]:
    rows: Any = rp.client().xrange(STREAM)
    return [(fields[b"batch_id"].decode(), fields[b"data"]) for _id, fields in rows]


async def flush_until_empty(box: Outbox, publish: Publish, timeout_s: float = 5.0) -> int:
    """Flush until nothing is pending; the first calls after a Redis restart may still meet
    pooled connections to the dead server (BusUnavailable), which flush absorbs."""
    sent, deadline = 0, time.monotonic() + timeout_s
    while box.pending() and time.monotonic() < deadline:
        n = await box.flush(publish)
        sent += n
        if not n:
            await asyncio.sleep(0.05)
    return sent


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Outbox]:
    b = Outbox.open(tmp_path / "outbox")
    try:
        yield b
    finally:
        b.close()


# -- with Redis ----------------------------------------------------------------------------------


def test_puts_while_redis_is_down_survive_reopen_and_flush_in_order_exactly_once(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    path = tmp_path / "outbox"

    async def main() -> None:
        bus = await Bus.connect(redis_server.url, RUN, op_timeout_s=2.0)
        publish = publisher(bus)
        box = Outbox.open(path)
        restarted: RedisProcess | None = None
        try:
            redis_server.stop(kill=True)
            for i in range(6):  # the actor's publish-or-outbox step
                try:
                    await bus.publish(STREAM, payload(i), **headers(i))
                except BusUnavailable:
                    assert box.put(f"b{i}", STREAM, payload(i), headers(i))
            assert box.pending() == 6

            box.close()  # the actor restarts: puts that returned are on disk
            box = Outbox.open(path)
            assert box.pending() == 6
            assert [e.key for e in box.peek()] == [f"b{i}" for i in range(6)]
            assert await box.flush(publish) == 0 and box.pending() == 6  # still down: nothing lost

            restarted = start_redis(tmp_path / "redis-new", port=redis_server.port)
            assert await flush_until_empty(box, publish) == 6
            assert box.pending() == 0
            assert stream_batches(restarted) == [(f"b{i}", payload(i)) for i in range(6)]
            assert await box.flush(publish) == 0
        finally:
            box.close()
            await bus.close()
            if restarted is not None:
                restarted.stop(kill=True)

    arun(main())


def test_flush_stops_at_bus_unavailable_and_keeps_the_rest(redis_server: RedisProcess, box: Outbox) -> None:
    for i in range(6):
        box.put(f"b{i}", STREAM, payload(i), headers(i))

    async def main() -> None:
        bus = await Bus.connect(redis_server.url, RUN, op_timeout_s=2.0)
        restarted: RedisProcess | None = None
        calls = 0

        async def publish_then_die(stream: str, data: bytes, hdrs: dict[str, str]) -> str:
            nonlocal calls
            calls += 1
            if calls == 3:
                redis_server.stop(kill=True)  # Redis dies in the middle of a flush
            return await bus.publish(stream, data, **hdrs)

        try:
            assert await box.flush(publish_then_die) == 2
            assert [e.key for e in box.peek()] == ["b2", "b3", "b4", "b5"]
            # Same port, same data directory: what was published before the kill is still there.
            restarted = start_redis(redis_server.dir, port=redis_server.port)
            assert await flush_until_empty(box, publisher(bus)) == 4
            assert stream_batches(restarted) == [(f"b{i}", payload(i)) for i in range(6)]
        finally:
            await bus.close()
            if restarted is not None:
                restarted.stop(kill=True)

    arun(main())


FLUSH_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from services.actor.outbox import Outbox
    from services.core.transport.bus import Bus

    path, url, run, hang_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    async def main():
        bus = await Bus.connect(url, run)
        box = Outbox.open(path)
        n = 0

        async def publish(stream, data, headers):
            nonlocal n
            msg_id = await bus.publish(stream, data, **headers)
            n += 1
            print(headers["batch_id"], flush=True)  # on Redis now, not yet deleted here
            if n == hang_after:
                await asyncio.sleep(3600)  # park between publish and delete: the kill lands here
            await asyncio.sleep(0.005)
            return msg_id

        await box.flush(publish)
        print("done", flush=True)

    asyncio.run(main())
    """
)


def test_kill_9_during_flush_never_loses_an_entry(redis_server: RedisProcess, tmp_path: Path) -> None:
    path, n = tmp_path / "outbox", 24
    with Outbox.open(path) as box:
        for i in range(n):
            box.put(f"b{i}", STREAM, payload(i), headers(i))

    # Round 1 parks right after the 4th publish (deterministically in the publish→delete window);
    # round 2 is killed after a few publishes wherever it happens to be.
    for hang_after, lines_before_kill in ((4, 4), (0, 5)):
        proc = subprocess.Popen(
            [sys.executable, "-c", FLUSH_CHILD, str(path), redis_server.url, RUN, str(hang_after)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.stdout is not None
        for _ in range(lines_before_kill):
            line = proc.stdout.readline()
            assert line and line != "done\n", f"flush child ended early (rc={proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()

    async def main() -> None:
        bus = await Bus.connect(redis_server.url, RUN)
        try:
            with Outbox.open(path) as box:
                await flush_until_empty(box, publisher(bus))
                assert box.pending() == 0
        finally:
            await bus.close()

    arun(main())
    got = stream_batches(redis_server)
    ids = [b for b, _ in got]
    firsts = list(dict.fromkeys(ids))
    assert firsts == [f"b{i}" for i in range(n)], "an entry was lost or went out of order"
    assert all(data == payload(int(b[1:])) for b, data in got)
    # At-least-once: the entry published but not yet deleted at a kill goes out again (downstream
    # dedups by batch id). At most one such entry per kill.
    dups = len(ids) - len(firsts)
    assert ids.count("b3") == 2 and 1 <= dups <= 2


# -- without Redis -------------------------------------------------------------------------------


def test_other_publish_errors_propagate_and_keep_the_entry(box: Outbox) -> None:
    for i in range(3):
        box.put(f"b{i}", STREAM, payload(i), headers(i))
    sent: list[str] = []

    async def publish(stream: str, data: bytes, hdrs: dict[str, str]) -> str:
        if hdrs["batch_id"] == "b1":
            raise ValueError("poison")
        sent.append(hdrs["batch_id"])
        return "0-1"

    with pytest.raises(ValueError, match="poison"):
        arun(box.flush(publish))
    assert sent == ["b0"] and [e.key for e in box.peek()] == ["b1", "b2"]
    assert box.discard(box.peek(1)[0].seq) is True  # an operator can drop a poison entry
    assert arun(box.flush(publish)) == 1 and box.pending() == 0


def test_only_one_flush_runs_at_a_time(box: Outbox) -> None:
    for i in range(3):
        box.put(f"b{i}", STREAM, payload(i), headers(i))
    published: list[str] = []

    async def slow(stream: str, data: bytes, hdrs: dict[str, str]) -> str:
        await asyncio.sleep(0.01)
        published.append(hdrs["batch_id"])
        return "0-1"

    async def main() -> tuple[int, int]:
        a, b = await asyncio.gather(box.flush(slow), box.flush(slow))
        return a, b

    assert sorted(arun(main())) == [0, 3]
    assert published == ["b0", "b1", "b2"]  # never one entry twice


def test_put_is_idempotent_per_pending_key_and_sequence_never_restarts(tmp_path: Path) -> None:
    path = tmp_path / "outbox"
    with Outbox.open(path) as box:
        assert box.put("b0", STREAM, b"x", {}) is True
        assert box.put("b0", STREAM, b"y", {}) is False  # a retried put queues no second copy
        assert box.put("b1", STREAM, b"z", {"kind": "rollout"}) is True
        [e0, e1] = box.peek()
        assert isinstance(e0, OutboxEntry) and (e0.key, e0.data, e0.seq) == ("b0", b"x", 0)
        assert (e1.key, e1.headers, e1.seq) == ("b1", {"kind": "rollout"}, 1)
        assert arun(box.flush(lambda s, d, h: asyncio.sleep(0, result="1-0"))) == 2
        with pytest.raises(OutboxError, match="already open in this process"):
            Outbox.open(path)
    with Outbox.open(path) as box:  # emptied and reopened: sequence numbers keep growing
        assert box.pending() == 0
        assert box.put("b0", STREAM, b"again", {}) is True  # flushed keys may come back
        assert [(e.key, e.seq) for e in box.peek()] == [("b0", 2)]
        with pytest.raises(OutboxError, match="non-empty string"):
            box.put("", STREAM, b"x", {})
    with pytest.raises(OutboxError, match="is closed"):
        box.pending()


def test_full_map_grows_and_max_map_size_raises_outbox_full(tmp_path: Path) -> None:
    with Outbox.open(tmp_path / "grow", map_size=64 * KiB, max_map_size=64 << 20, sync=False) as box:
        blobs = {f"b{i}": os.urandom(100 * KiB) for i in range(40)}  # 4 MB through a 64 KiB map
        for key, data in blobs.items():
            box.put(key, STREAM, data, {})
        assert box.map_size >= 4 << 20
        assert {e.key: e.data for e in box.peek()} == blobs

    path = tmp_path / "capped"
    with Outbox.open(path, map_size=64 * KiB, max_map_size=512 * KiB, sync=False) as box:
        kept: list[str] = []
        with pytest.raises(OutboxFull) as err:
            for i in range(40):
                box.put(f"b{i}", STREAM, os.urandom(64 * KiB), {})
                kept.append(f"b{i}")
        msg = str(err.value)
        assert str(path) in msg and "reached max_map_size 524288" in msg and "entries are intact" in msg
        assert kept and [e.key for e in box.peek()] == kept


def test_full_disk_raises_outbox_full_then_accepts_puts_when_space_returns(small_fs: Path) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (768 * KiB))  # the space handed back later
    path = small_fs / "outbox"
    box = Outbox.open(path, map_size=64 * KiB)
    try:
        kept: list[str] = []
        with pytest.raises(OutboxFull) as err:
            for i in range(100):  # 100 x 64 KiB is three times the filesystem
                box.put(f"b{i}", STREAM, os.urandom(64 * KiB), {})
                kept.append(f"b{i}")
        assert str(path) in str(err.value) and "bytes free on its filesystem" in str(err.value)
        assert kept and [e.key for e in box.peek()] == kept
        filler.unlink()
        box.put("after", STREAM, b"small", {})
        assert box.peek()[-1].key == "after"
    finally:
        box.close()
    with Outbox.open(path) as box:
        assert [e.key for e in box.peek()] == [*kept, "after"]
