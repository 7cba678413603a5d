"""One message through each path, one in flight (rlfleet's codec and Bus; raw redis-py, sync and
asyncio), and the clients and streams they share, emptied between phases."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from bench.data_plane.batches import stream_entries
from bench.data_plane.config import CONSUMER, GROUP
from services.core.transport.bus import Bus


async def rlfleet_hop(
    bus: Bus,
    stream: str,
    group: str,
    encode: Callable[[], bytes],
    decode: Callable[[bytes], object],
    headers: dict[str, str],
) -> tuple[dict[str, float], str, object]:
    """encode -> publish -> read -> decode -> ack, one message in flight; returns the timings
    (seconds; `latency` ends at the decoded object, `cycle` after the ack), the entry id and the
    decoded object."""
    t0 = time.perf_counter()
    data = encode()
    t1 = time.perf_counter()
    await bus.publish(stream, data, **headers)
    t2 = time.perf_counter()
    msgs = await bus.read(stream, group, CONSUMER, count=1, block_ms=2000)
    t3 = time.perf_counter()
    if len(msgs) != 1:
        raise RuntimeError(f"expected 1 message on {stream}, got {len(msgs)}")
    decoded = decode(msgs[0].data)
    t4 = time.perf_counter()
    await bus.ack(msgs[0], group)
    t5 = time.perf_counter()
    timing = {"latency": t4 - t0, "cycle": t5 - t0, "encode": t1 - t0, "publish": t2 - t1, "read": t3 - t2,
              "decode": t4 - t3, "ack": t5 - t4, "bytes": float(len(data))}
    return timing, msgs[0].id, decoded


def raw_sync_hop(
    client: redis.Redis, stream: str, fields: dict[bytes, bytes]
) -> tuple[dict[str, float], bytes]:
    t0 = time.perf_counter()
    client.xadd(stream, fields)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    entries = stream_entries(client.xreadgroup(GROUP, CONSUMER, {stream: ">"}, count=1, block=2000))
    t2 = time.perf_counter()
    if len(entries) != 1:
        raise RuntimeError(f"expected 1 entry on {stream}, got {len(entries)}")
    rid, got = entries[0]
    data = got[b"data"]
    client.xack(stream, GROUP, rid)
    t3 = time.perf_counter()
    return {"latency": t2 - t0, "cycle": t3 - t0, "publish": t1 - t0, "read": t2 - t1, "ack": t3 - t2,
            "bytes": float(len(data))}, rid


async def raw_async_hop(
    client: aioredis.Redis, stream: str, fields: dict[bytes, bytes]
) -> tuple[dict[str, float], bytes]:
    t0 = time.perf_counter()
    await client.xadd(stream, fields)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    entries = stream_entries(await client.xreadgroup(GROUP, CONSUMER, {stream: ">"}, count=1, block=2000))
    t2 = time.perf_counter()
    if len(entries) != 1:
        raise RuntimeError(f"expected 1 entry on {stream}, got {len(entries)}")
    rid, got = entries[0]
    data = got[b"data"]
    await client.xack(stream, GROUP, rid)
    t3 = time.perf_counter()
    return {"latency": t2 - t0, "cycle": t3 - t0, "publish": t1 - t0, "read": t2 - t1, "ack": t3 - t2,
            "bytes": float(len(data))}, rid


@dataclass
class Clients:
    bus: Bus
    sync: redis.Redis
    aio: aioredis.Redis
    streams: dict[str, str]  # path -> stream key

    @property
    def max_bytes(self) -> int:
        return self.bus.max_message_bytes


def _wait_aof_idle(client: redis.Redis, timeout_s: float = 20.0) -> float:
    """Wait for a background AOF rewrite to finish so it does not land in the next phase."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        info: Any = client.info("persistence")
        if not int(info.get("aof_rewrite_in_progress", 0)) and not int(info.get("aof_rewrite_scheduled", 0)):
            break
        time.sleep(0.05)
    return time.monotonic() - t0


def aof_rewrites(client: redis.Redis) -> int | None:
    info: Any = client.info("persistence")
    value = info.get("aof_rewrites")
    return None if value is None else int(value)


async def reset(c: Clients, streams: Sequence[str], groups: Sequence[str] = (GROUP,)) -> None:
    """Empty the streams, recreate the groups, and let any AOF rewrite finish."""
    c.sync.delete(*streams)
    for stream in streams:
        await c.bus.ensure_groups(stream, list(groups))
    _wait_aof_idle(c.sync)
