"""The Redis Streams bus against a real redis-server (tests/conftest.py starts one per test).

There is no pytest-asyncio: each test drives its coroutine with `arun`, which also bounds it in
time. Every wait below is a bounded poll, never a bare sleep-and-hope."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.core.host.redis_proc import RedisProcess, free_port, start_redis
from services.core.transport.bus import Bus, BusError, BusUnavailable, Message, MessageTooLarge, StreamKeys

T = TypeVar("T")
RUN = "bustest"
KEYS = StreamKeys(RUN)
STAGES = ["reference", "reward", "critic"]


def arun(coro: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def connect(rp: RedisProcess, **overrides: Any) -> Bus:
    opts: dict[str, Any] = {"max_message_bytes": 64 * 1024, "max_deliveries": 3, "reclaim_idle_ms": 200}
    opts.update(overrides)
    return await Bus.connect(rp.url, RUN, **opts)


async def read_until(
    bus: Bus, stream: str, group: str, consumer: str, want: int, timeout_s: float = 3.0
) -> list[Message]:
    """Read until `want` messages arrived or the deadline passed (then return what came)."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += await bus.read(stream, group, consumer, count=want - len(got), block_ms=50)
    return got


def dead_records(rp: RedisProcess) -> list[dict[str, bytes]]:
    rows: Any = rp.client().xrange(KEYS.dead)
    return [{k.decode(): v for k, v in fields.items()} for _id, fields in rows]


def stream_ids(rp: RedisProcess, stream: str) -> list[str]:
    rows: Any = rp.client().xrange(stream)
    return [i.decode() for i, _fields in rows]


def test_publish_read_ack_round_trip(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.prompts, ["actor"])
            await bus.ensure_groups(KEYS.prompts, ["actor"])  # idempotent (BUSYGROUP)
            msg_id = await bus.publish(
                KEYS.prompts, b"\x00\x01payload", kind="prompts", task_count="4", batch_id="b1", schema="1"
            )
            [msg] = await bus.read(KEYS.prompts, "actor", "actor-0", count=10, block_ms=100)
            assert (msg.stream, msg.id, msg.data) == (KEYS.prompts, msg_id, b"\x00\x01payload")
            assert msg.deliveries == 1
            assert msg.headers == {"kind": "prompts", "task_count": "4", "batch_id": "b1", "schema": "1"}
            assert await bus.ack(msg, "actor") is True
            assert await bus.ack(msg, "actor") is False  # a second ack is a harmless no-op
            assert await bus.read(KEYS.prompts, "actor", "actor-0", count=10, block_ms=50) == []
            assert await bus.group_backlog(KEYS.prompts, "actor") == (0, 0)
            assert (await bus.stream_depths())["prompts"] == 1
        finally:
            await bus.close()

    arun(main())


def test_every_stage_group_gets_every_rollout(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.rollouts, STAGES)
            ids = [await bus.publish(KEYS.rollouts, f"r{i}".encode(), kind="rollout") for i in range(5)]
            for stage in STAGES:
                got = await read_until(bus, KEYS.rollouts, stage, f"{stage}-0", want=5)
                assert [m.id for m in got] == ids, stage
                for m in got:
                    await bus.ack(m, stage)
            for stage in STAGES:
                assert await bus.group_backlog(KEYS.rollouts, stage) == (0, 0)
        finally:
            await bus.close()

    arun(main())


def test_unacked_message_is_redelivered_to_another_consumer_after_reclaim_idle(
    redis_server: RedisProcess,
) -> None:
    async def main() -> None:
        crashed, survivor = await connect(redis_server), await connect(redis_server)
        try:
            await crashed.ensure_groups(KEYS.rollouts, ["reward"])
            msg_id = await crashed.publish(KEYS.rollouts, b"work", batch_id="b7")
            [first] = await crashed.read(KEYS.rollouts, "reward", "reward-0", count=1, block_ms=100)
            # Not idle long enough yet: nobody else may take it.
            assert await survivor.read(KEYS.rollouts, "reward", "reward-1", count=1, block_ms=0) == []
            [again] = await read_until(survivor, KEYS.rollouts, "reward", "reward-1", want=1)
            assert (again.id, again.data, again.headers) == (msg_id, b"work", first.headers)
            assert again.deliveries == 2
            assert await survivor.ack(again, "reward") is True
            assert redis_server.client().xpending(KEYS.rollouts, "reward")["pending"] == 0
        finally:
            await crashed.close()
            await survivor.close()

    arun(main())


def test_message_delivered_max_deliveries_times_goes_to_dead_stream_and_is_acked(
    redis_server: RedisProcess,
) -> None:
    async def main() -> None:
        bus = await connect(redis_server, max_deliveries=2, reclaim_idle_ms=150)
        try:
            await bus.ensure_groups(KEYS.rollouts, ["critic"])
            msg_id = await bus.publish(KEYS.rollouts, b"poison", kind="rollout", batch_id="b9")
            [m1] = await bus.read(KEYS.rollouts, "critic", "critic-0", count=1, block_ms=100)
            [m2] = await read_until(bus, KEYS.rollouts, "critic", "critic-1", want=1)
            assert (m1.deliveries, m2.deliveries) == (1, 2)
            # The third consumer must not get it: it goes to the dead-letter stream instead.
            deadline = time.monotonic() + 3.0
            while not dead_records(redis_server) and time.monotonic() < deadline:
                assert await bus.read(KEYS.rollouts, "critic", "critic-2", count=1, block_ms=50) == []
            [rec] = dead_records(redis_server)
            assert b"2 deliveries" in rec["reason"] and b"max_deliveries=2" in rec["reason"]
            assert rec["stream"] == KEYS.rollouts.encode() and rec["id"] == msg_id.encode()
            assert (rec["group"], rec["deliveries"], rec["data"]) == (b"critic", b"2", b"poison")
            assert rec["h.batch_id"] == b"b9"
            assert redis_server.client().xpending(KEYS.rollouts, "critic")["pending"] == 0
        finally:
            await bus.close()

    arun(main())


def test_explicit_dead_letter_keeps_reason_and_data(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reference"])
            await bus.publish(KEYS.rollouts, b"\xffbad-tensor", kind="rollout", batch_id="b3")
            [msg] = await bus.read(KEYS.rollouts, "reference", "reference-0", count=1, block_ms=100)
            reason = "wrong tensor shape (4, 7) for response_ids, expected (4, 8)"
            await bus.dead_letter(msg, "reference", reason)
            [rec] = dead_records(redis_server)
            assert rec["reason"].decode() == reason
            assert (rec["data"], rec["truncated"], rec["data_bytes"]) == (b"\xffbad-tensor", b"0", b"11")
            assert (rec["id"].decode(), rec["group"], rec["deliveries"]) == (msg.id, b"reference", b"1")
            assert redis_server.client().xpending(KEYS.rollouts, "reference")["pending"] == 0
        finally:
            await bus.close()

    arun(main())


def test_malformed_entry_goes_to_dead_stream_instead_of_consumer(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.scores, ["controller"])
            redis_server.client().xadd(KEYS.scores, {"kind": "scores"})  # a foreign writer, no data
            assert await bus.read(KEYS.scores, "controller", "controller-0", count=5, block_ms=50) == []
            [rec] = dead_records(redis_server)
            assert b"no 'data' field" in rec["reason"] and rec["h.kind"] == b"scores"
            assert redis_server.client().xpending(KEYS.scores, "controller")["pending"] == 0
        finally:
            await bus.close()

    arun(main())


def test_trim_never_drops_unacknowledged_entries_but_drops_fully_acked(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        r = redis_server.client()
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reward", "reference"])
            ids = [await bus.publish(KEYS.rollouts, f"r{i}".encode()) for i in range(6)]
            assert await bus.trim_acked(KEYS.rollouts) == 0  # nobody read anything yet
            for m in await read_until(bus, KEYS.rollouts, "reward", "reward-0", want=6):
                await bus.ack(m, "reward")
            # "reference" lags: reads three, acks two, leaves ids[2] pending and ids[3:] unread.
            lagging = await read_until(bus, KEYS.rollouts, "reference", "reference-0", want=3)
            for m in lagging[:2]:
                await bus.ack(m, "reference")
            assert await bus.trim_acked(KEYS.rollouts) == 2
            assert stream_ids(redis_server, KEYS.rollouts) == ids[2:]
            assert await bus.trim_acked(KEYS.rollouts) == 0
            await bus.ack(lagging[2], "reference")
            for m in await read_until(bus, KEYS.rollouts, "reference", "reference-0", want=3):
                await bus.ack(m, "reference")
            assert await bus.trim_acked(KEYS.rollouts) == 4
            assert r.xlen(KEYS.rollouts) == 0
            assert await bus.trim_acked(KEYS.dead) == 0  # no groups: never trimmed
        finally:
            await bus.close()

    arun(main())


def test_trim_is_skipped_while_a_known_group_is_missing(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reward", "reference"])
            for i in range(2):
                await bus.publish(KEYS.rollouts, f"r{i}".encode())
            for m in await read_until(bus, KEYS.rollouts, "reward", "reward-0", want=2):
                await bus.ack(m, "reward")
            # "reference" vanished (e.g. Redis lost it); it will be recreated at 0 and need both.
            redis_server.client().xgroup_destroy(KEYS.rollouts, "reference")
            assert await bus.trim_acked(KEYS.rollouts) == 0
            assert redis_server.client().xlen(KEYS.rollouts) == 2
            assert await bus.group_backlog(KEYS.rollouts, "reference") == (2, 0)
        finally:
            await bus.close()

    arun(main())


def test_oversized_publish_is_rejected_before_sending(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server, max_message_bytes=1024)
        try:
            with pytest.raises(MessageTooLarge, match=r"1025 bytes, over flow\.max_message_bytes=1024"):
                await bus.publish(KEYS.rollouts, b"x" * 1025, kind="rollout")
            assert redis_server.client().exists(KEYS.rollouts) == 0  # nothing reached Redis
            await bus.publish(KEYS.rollouts, b"x" * 1024, kind="rollout")
        finally:
            await bus.close()

    arun(main())


def test_redis_killed_raises_bus_unavailable_naming_host_port(redis_server: RedisProcess) -> None:
    endpoint = f"127.0.0.1:{redis_server.port}"

    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reward"])
            await bus.publish(KEYS.rollouts, b"before")
            redis_server.stop(kill=True)
            started = time.monotonic()
            with pytest.raises(BusUnavailable, match=endpoint) as info:
                await bus.publish(KEYS.rollouts, b"after")
            assert isinstance(info.value, ConnectionError) and info.value.endpoint == endpoint
            with pytest.raises(BusUnavailable, match=endpoint):
                await bus.read(KEYS.rollouts, "reward", "reward-0", count=1, block_ms=100)
            assert time.monotonic() - started < 5.0  # fails fast; the caller decides how to wait
        finally:
            await bus.close()
        # Connecting to nothing: the error names host:port and never the password.
        port = free_port()
        with pytest.raises(BusUnavailable, match=f"127.0.0.1:{port}") as info:
            await Bus.connect(f"redis://:s3cret@127.0.0.1:{port}/0", RUN)
        assert "s3cret" not in str(info.value)

    arun(main())


def test_read_recreates_group_after_redis_restarts_empty(redis_server: RedisProcess, tmp_path: Path) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        restarted: RedisProcess | None = None
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reward"])
            await bus.publish(KEYS.rollouts, b"old")
            [old] = await bus.read(KEYS.rollouts, "reward", "reward-0", count=1, block_ms=100)
            await bus.ack(old, "reward")
            redis_server.stop(kill=True)
            # Same port, fresh data directory: Redis comes back with no streams and no groups.
            restarted = start_redis(tmp_path / "redis-empty", port=redis_server.port)
            got: list[Message] | None = None
            deadline = time.monotonic() + 5.0
            while got is None and time.monotonic() < deadline:
                try:
                    got = await bus.read(KEYS.rollouts, "reward", "reward-0", count=1, block_ms=50)
                except BusUnavailable:
                    await asyncio.sleep(0.05)  # pooled connections to the dead server are dropped
            assert got == []
            assert [g["name"] for g in restarted.client().xinfo_groups(KEYS.rollouts)] == [b"reward"]
            new_id = await bus.publish(KEYS.rollouts, b"new")
            [new] = await bus.read(KEYS.rollouts, "reward", "reward-0", count=1, block_ms=100)
            assert (new.id, new.data) == (new_id, b"new")
            assert await bus.ack(new, "reward") is True
        finally:
            await bus.close()
            if restarted is not None:
                restarted.stop(kill=True)

    arun(main())


def test_fill_ratio_reflects_the_slowest_group(redis_server: RedisProcess) -> None:
    async def main() -> None:
        bus = await connect(redis_server)
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reward", "reference"])
            assert await bus.fill_ratio(KEYS.rollouts, ["reward", "reference"], capacity=10) == 0.0
            for i in range(6):
                await bus.publish(KEYS.rollouts, f"r{i}".encode())
            for m in await read_until(bus, KEYS.rollouts, "reward", "reward-0", want=6):
                await bus.ack(m, "reward")
            await read_until(bus, KEYS.rollouts, "reference", "reference-0", want=2)  # held, not acked
            assert await bus.group_backlog(KEYS.rollouts, "reward") == (0, 0)
            assert await bus.group_backlog(KEYS.rollouts, "reference") == (4, 2)
            ratio = await bus.fill_ratio(KEYS.rollouts, ["reward", "reference"], capacity=10)
            assert ratio == pytest.approx(0.6)
            assert await bus.fill_ratio(KEYS.rollouts, ["reward"], capacity=10) == 0.0
        finally:
            await bus.close()

    arun(main())


def test_connect_waits_for_a_redis_that_starts_late(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A service (re)started while Redis is down waits for it instead of exiting."""
    port = free_port()
    started: list[RedisProcess] = []
    timer = threading.Timer(2.0, lambda: started.append(start_redis(tmp_path / "late", port=port,
                                                                    password="s3cret")))
    timer.start()

    async def main() -> None:
        t0 = time.monotonic()
        bus = await Bus.connect(f"redis://127.0.0.1:{port}/0", RUN, password="s3cret", wait_s=30.0)
        try:
            assert time.monotonic() - t0 >= 1.5  # it really waited for the late start
            await bus.ensure_groups(KEYS.rollouts, ["reward"])
            await bus.publish(KEYS.rollouts, b"after the wait")
        finally:
            await bus.close()

    try:
        with caplog.at_level(logging.WARNING, logger="services.core.transport.bus"):
            arun(main(), timeout_s=40.0)
    finally:
        timer.join()
        for rp in started:
            rp.stop(kill=True)
    waits = [r for r in caplog.records if r.getMessage() == f"waiting for Redis at 127.0.0.1:{port}"]
    assert waits, "no 'waiting for Redis at host:port' line was logged"
    assert all("s3cret" not in str(vars(r)) for r in caplog.records)


def test_connect_gives_up_when_its_wait_runs_out() -> None:
    port = free_port()

    async def main() -> None:
        t0 = time.monotonic()
        with pytest.raises(BusUnavailable, match=f"127.0.0.1:{port}"):
            await Bus.connect(f"redis://127.0.0.1:{port}/0", RUN, wait_s=1.0)
        assert 0.9 <= time.monotonic() - t0 < 8.0

    arun(main())


def test_refused_credentials_fail_at_once_even_while_waiting(tmp_path: Path) -> None:
    rp = start_redis(tmp_path / "auth", password="right")

    async def main() -> None:
        t0 = time.monotonic()
        with pytest.raises(BusError, match="credentials") as info:
            await Bus.connect(f"redis://127.0.0.1:{rp.port}/0", RUN, password="wrong", wait_s=30.0)
        assert not isinstance(info.value, BusUnavailable) and "wrong" not in str(info.value)
        assert time.monotonic() - t0 < 5.0

    try:
        arun(main())
    finally:
        rp.stop(kill=True)


@pytest.mark.parametrize(("setting", "value", "normal"), [
    ("maxmemory", "1", "0"),                    # OOM command not allowed
    ("min-replicas-to-write", "1", "0"),         # NOREPLICAS
], ids=["oom", "noreplicas"])
def test_a_refusal_that_passes_by_itself_is_an_outage_and_the_bus_resumes(
    setting: str, value: str, normal: str, redis_server: RedisProcess
) -> None:
    """Redis refusing writes for a passing reason (memory, a full disk's MISCONF, replicas) must
    read as BusUnavailable, which every caller holds work for, not as a crash-worthy error."""

    async def main() -> None:
        bus = await connect(redis_server)
        admin = redis_server.client()
        try:
            await bus.ensure_groups(KEYS.rollouts, ["reward"])
            admin.config_set(setting, value)
            with pytest.raises(BusUnavailable, match=f"127.0.0.1:{redis_server.port}"):
                await bus.publish(KEYS.rollouts, b"refused")
            admin.config_set(setting, normal)
            await bus.publish(KEYS.rollouts, b"accepted")
            [msg] = await read_until(bus, KEYS.rollouts, "reward", "reward-0", want=1)
            assert msg.data == b"accepted"
        finally:
            admin.config_set(setting, normal)
            await bus.close()

    arun(main())
