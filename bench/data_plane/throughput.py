"""Throughput with K batches in flight, the paths taking turns pass by pass: batches/s and MB/s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.data_plane.batches import Batch, decode_rollout, encode_rollout, stream_entries
from bench.data_plane.config import CONSUMER, GROUP, MB, PATHS
from bench.data_plane.hops import Clients, aof_rewrites, reset
from bench.data_plane.stats import median, summary_ms


async def _throughput_rlfleet(c: Clients, batch: Batch, n: int, k: int, tag: str) -> dict[str, Any]:
    stream = c.streams["rlfleet"]
    sem = asyncio.Semaphore(k)
    start: dict[str, float] = {}
    latency: list[float] = []
    sizes: list[int] = []

    async def produce() -> None:
        for i in range(n):
            await sem.acquire()
            bid = f"b{i}:{tag}"
            start[bid] = time.perf_counter()
            data = encode_rollout(batch, bid)
            sizes.append(len(data))
            await c.bus.publish(stream, data, kind="rollout", batch_id=bid)

    async def consume() -> None:
        got = 0
        while got < n:
            for msg in await c.bus.read(stream, GROUP, CONSUMER, count=k, block_ms=2000):
                decode_rollout(msg.data, c.max_bytes)
                latency.append(time.perf_counter() - start[msg.headers["batch_id"]])
                await c.bus.ack(msg, GROUP)
                sem.release()
                got += 1

    t0 = time.perf_counter()
    await asyncio.gather(produce(), consume())
    wall = time.perf_counter() - t0
    return _throughput_report(n, k, wall, latency, sum(sizes) / len(sizes))


async def _throughput_raw_async(c: Clients, payload: bytes, n: int, k: int) -> dict[str, Any]:
    stream = c.streams["raw_async"]
    sem = asyncio.Semaphore(k)
    start: dict[bytes, float] = {}
    latency: list[float] = []

    async def produce() -> None:
        for i in range(n):
            await sem.acquire()
            bid = f"b{i}".encode()
            start[bid] = time.perf_counter()
            await c.aio.xadd(stream, {b"kind": b"rollout", b"batch_id": bid, b"data": payload})  # type: ignore[arg-type]

    async def consume() -> None:
        got = 0
        while got < n:
            resp = await c.aio.xreadgroup(GROUP, CONSUMER, {stream: ">"}, count=k, block=2000)
            for rid, fields in stream_entries(resp):
                latency.append(time.perf_counter() - start[fields[b"batch_id"]])
                await c.aio.xack(stream, GROUP, rid)
                sem.release()
                got += 1

    t0 = time.perf_counter()
    await asyncio.gather(produce(), consume())
    wall = time.perf_counter() - t0
    return _throughput_report(n, k, wall, latency, float(len(payload)))


def _throughput_raw_sync(c: Clients, payload: bytes, n: int, k: int) -> dict[str, Any]:
    """A sync client cannot overlap calls; it keeps K in flight by pipelining windows of K: K XADDs in
    one round trip, XREADGROUP COUNT K, one XACK of the K ids."""
    stream = c.streams["raw_sync"]
    latency: list[float] = []
    t0 = time.perf_counter()
    i = 0
    while i < n:
        w = min(k, n - i)
        start = time.perf_counter()
        pipe = c.sync.pipeline(transaction=False)
        for j in range(w):
            pipe.xadd(stream, {b"kind": b"rollout", b"batch_id": f"b{i + j}".encode(), b"data": payload})  # type: ignore[arg-type]
        pipe.execute()
        ids: list[bytes] = []
        while len(ids) < w:
            resp = c.sync.xreadgroup(GROUP, CONSUMER, {stream: ">"}, count=w - len(ids), block=2000)
            for rid, _fields in stream_entries(resp):
                ids.append(rid)
                latency.append(time.perf_counter() - start)
        c.sync.xack(stream, GROUP, *ids)
        i += w
    wall = time.perf_counter() - t0
    return _throughput_report(n, k, wall, latency, float(len(payload)))


def _throughput_report(
    n: int, k: int, wall: float, latency: list[float], mean_bytes: float
) -> dict[str, Any]:
    return {"batches": n, "in_flight": k, "wall_s": wall, "batches_per_s": n / wall, "bytes_mean": mean_bytes,
            "latency_samples_s": latency}


async def measure_throughput(
    c: Clients, batch: Batch, payload: bytes, n: int, k: int, warmup: int, rounds: int
) -> dict[str, Any]:
    """Each path with K in flight. The N batches are split into `rounds` passes and the paths take
    turns pass by pass (rotating order), so a transient disturbance hits one pass of each rather
    than one path; batches/s is the median over passes (`pooled`: all batches over all wall time).
    Before every pass the stream is emptied and any AOF rewrite awaited; during a pass entries stay
    in the stream (no deletes in the timed region). A warm-up pass first opens the K pooled
    connections of each path."""

    async def raw_sync(m: int) -> dict[str, Any]:
        return _throughput_raw_sync(c, payload, m, k)

    runs: dict[str, Callable[[int], Awaitable[dict[str, Any]]]] = {
        "rlfleet": lambda m: _throughput_rlfleet(c, batch, m, k, tag=f"tp{m}"),
        "raw_sync": raw_sync,
        "raw_async": lambda m: _throughput_raw_async(c, payload, m, k),
    }
    rounds = max(1, min(rounds, n))
    sizes = [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
    passes: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    for path in PATHS:
        await reset(c, [c.streams[path]])
        await runs[path](max(warmup, k))
    before = aof_rewrites(c.sync)
    for r, m in enumerate(sizes):
        shift = r % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            await reset(c, [c.streams[path]])
            passes[path].append(await runs[path](m))
    after = aof_rewrites(c.sync)
    await reset(c, list(c.streams.values()))
    out: dict[str, Any] = {}
    for path, ps in passes.items():
        wall = sum(p["wall_s"] for p in ps)
        total_bytes = sum(p["bytes_mean"] * p["batches"] for p in ps)
        latency = [x for p in ps for x in p["latency_samples_s"]]
        bps = median([p["batches_per_s"] for p in ps])
        mean_bytes = total_bytes / n
        out[path] = {
            "batches": n, "in_flight": k, "rounds": len(ps), "batches_per_s": bps,
            "mb_per_s": bps * mean_bytes / MB, "batches_per_s_pooled": n / wall,
            "mb_per_s_pooled": total_bytes / wall / MB, "bytes_mean": mean_bytes,
            "latency_ms": summary_ms(latency), "passes": ps,
        }
    out["aof_rewrites_during"] = None if before is None or after is None else after - before
    return out
