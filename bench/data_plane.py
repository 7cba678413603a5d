"""CPU benchmark of the data plane: what rlfleet's Redis Streams path costs over raw redis-py.

One run starts a private redis-server on loopback with the production settings (AOF on,
appendfsync everysec, noeviction), measures, and stops it. Client work runs in this one Python
process (producer and consumer share it), so rlfleet and its peer see the same host and server:

1. latency, one batch in flight, the three paths interleaved sample by sample (rotating order):
   - rlfleet: `wire.rollout_to_proto(...).SerializeToString()` -> `Bus.publish` -> `Bus.read`
     (consumer group) -> `wire.parse_message` + `validate_rollout_batch` -> `Bus.ack`;
     latency is publish start (encode included) to the decoded `Rollout`;
   - raw redis-py, sync and asyncio clients: XADD / XREADGROUP / XACK of the same bytes,
     serialized once; latency is XADD start to the bytes in hand (the floor);
2. throughput, K batches in flight (producer and consumer tasks; the sync client pipelines windows
   of K): batches/s and MB/s, the paths taking turns over several passes, median over passes;
3. the codec alone (encode, decode + validate; no Redis);
4. the tiny CPU run (examples/tiny-cpu.yaml): its PromptBatch, RolloutBatch and ScoreBatch (per
   stage) through the full rlfleet path, plus raw redis-py hops of the same RolloutBatch bytes,
   added up to the deliveries of one training step and compared with the step time of the local
   loop (`services.local.run_local` for a few steps in a child process, with a time limit).

    python -m bench.data_plane [--quick] [--out bench/results/data_plane-<stamp>.json]

Medians everywhere (p99 of 50 samples is close to the maximum); every sample, the config, the host
and how busy its CPUs were with other processes go to the JSON file. On a shared host pass
`--wait-quiet SECONDS`; the report warns when other processes competed for the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Final

import redis
import redis.asyncio as aioredis
import torch

from services.core.config.run import FlowSection, load_config
from services.core.host.redis_proc import RedisProcess, start_redis
from services.core.ids import task_id
from services.core.pb import rlfleet_pb2 as pb
from services.core.transport.bus import Bus
from services.rl import wire
from services.rl.batch import Rollout

ROOT: Final = Path(__file__).resolve().parents[1]
RUN: Final = "bench"
GROUP: Final = "reward"  # the consumer group of one scoring stage
CONSUMER: Final = "bench-1"
MB: Final = 1e6  # MB/s are 10^6 bytes per second
PATHS: Final = ("rlfleet", "raw_sync", "raw_async")
TENSORS: Final = (
    "prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "group_ids",
)
PATH_LABELS: Final = {
    "rlfleet": "rlfleet (codec+Bus)",
    "raw_sync": "raw redis-py sync",
    "raw_async": "raw redis-py asyncio",
}
# The budget for everything that talks to Redis; the local loop has its own limit.
REDIS_PHASES_TIMEOUT_S: Final = 300.0
TRANSPORT_TARGET: Final = 0.10  # "transport adds < 10% to a step of the tiny run"
NOISY_HOST: Final = 0.10  # warn when other processes took more than this share of the CPUs' user time


@dataclass(frozen=True)
class BenchConfig:
    batches: int = 50  # measured batches per path, in each mode
    warmup: int = 3  # unmeasured batches before them (connections, allocator, caches)
    in_flight: int = 4  # K for the throughput mode
    rounds: int = 5  # throughput passes per path, taking turns with the other paths
    seqs: int = 256
    prompt_len: int = 64
    response_len: int = 1024
    group_size: int = 8
    tiny_config: str = "examples/tiny-cpu.yaml"
    tiny_prompt_len: int = 6  # tokens of an arithmetic prompt such as "12+7="
    tiny_hops: int = 100  # measured hops of each tiny message kind
    local_loop: bool = True
    local_steps: int = 10
    local_warmup_steps: int = 2  # left out of the step-time median
    local_timeout_s: float = 45.0
    seed: int = 0


QUICK: Final = BenchConfig(batches=10, warmup=2, rounds=2, tiny_hops=30, local_steps=5, local_timeout_s=20.0)


# -- statistics ----------------------------------------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """n, p50, p99, mean, min, max of samples in seconds, reported in milliseconds."""
    ms = [x * 1e3 for x in samples_s]
    if not ms:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "mean": math.nan, "min": math.nan, "max": math.nan}
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "mean": sum(ms) / len(ms),
        "min": min(ms),
        "max": max(ms),
    }


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50)


# -- synthetic batches ---------------------------------------------------------------------------
@dataclass
class Batch:
    """One generated batch as the actor holds it before publishing."""

    rollout: Rollout
    finish_reasons: list[str]
    sampling: pb.SamplingParams


def make_batch(
    seqs: int,
    prompt_len: int,
    response_len: int,
    group_size: int,
    *,
    seed: int = 0,
    vocab: int = 151_936,
    pad_id: int = 0,
    eos_id: int = 1,
) -> Batch:
    """A realistic padded rollout: groups of `group_size` samples share a left-padded prompt of
    3/4..1 x `prompt_len` tokens; responses are right-padded, a quarter of them hit the length limit
    and the rest stop earlier; behaviour log-probs are negative on generated tokens, 0 on padding."""
    if min(seqs, prompt_len, response_len, group_size) < 1:
        raise ValueError("seqs, prompt_len, response_len and group_size must all be >= 1")
    g = torch.Generator().manual_seed(seed)
    n_groups = -(-seqs // group_size)
    group_of = torch.arange(seqs, dtype=torch.long) // group_size
    p_len = torch.randint(max(1, (3 * prompt_len) // 4), prompt_len + 1, (n_groups,), generator=g)[group_of]
    prompt_mask = torch.arange(prompt_len)[None, :] >= (prompt_len - p_len)[:, None]
    prompts = torch.randint(2, vocab, (n_groups, prompt_len), generator=g)[group_of]
    prompt_ids = prompts.masked_fill(~prompt_mask, pad_id)

    r_len = torch.randint(1, response_len + 1, (seqs,), generator=g)
    r_len = torch.where(torch.rand(seqs, generator=g) < 0.25, torch.tensor(response_len), r_len)
    response_mask = torch.arange(response_len)[None, :] < r_len[:, None]
    response_ids = torch.randint(2, vocab, (seqs, response_len), generator=g)
    stopped = r_len < response_len
    response_ids[stopped, r_len[stopped] - 1] = eos_id
    response_ids = response_ids.masked_fill(~response_mask, pad_id)
    logprobs = (-torch.empty(seqs, response_len).exponential_(generator=g)).masked_fill(~response_mask, 0.0)

    rollout = Rollout(
        task_ids=[task_id(int(gi), i % group_size) for i, gi in enumerate(group_of.tolist())],
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=logprobs,
        group_ids=group_of.clone(),
        version=3,
    )
    finish = ["stop" if bool(s) else "length" for s in stopped]
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=response_len,
                                 stop_token_ids=[eos_id], seed=seed)
    return Batch(rollout=rollout, finish_reasons=finish, sampling=sampling)


def encode_rollout(batch: Batch, batch_id: str) -> bytes:
    """What the actor does before `Bus.publish`."""
    msg = wire.rollout_to_proto(batch.rollout, batch_id, sampling=batch.sampling,
                                finish_reasons=batch.finish_reasons, generate_seconds=1.0)
    return msg.SerializeToString()


def decode_rollout(data: bytes, max_bytes: int) -> Rollout:
    """What a scoring stage (or the controller) does with a delivered entry."""
    msg = wire.parse_message(pb.RolloutBatch, data, max_bytes=max_bytes)
    return wire.validate_rollout_batch(msg, max_bytes)


def same_rollout(a: Rollout, b: Rollout) -> bool:
    return (
        a.task_ids == b.task_ids
        and a.version == b.version
        and all(torch.equal(getattr(a, n), getattr(b, n)) for n in TENSORS)
    )


def raw_fields(batch_id: str, data: bytes) -> dict[bytes, bytes]:
    """The stream entry the Bus writes (its headers, then the payload), for the raw peer."""
    return {b"kind": b"rollout", b"batch_id": batch_id.encode(), b"data": data}


def _entries(resp: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Entries of a single-stream XREADGROUP reply (RESP2: [[stream, [(id, fields), ...]]])."""
    return [(rid, fields) for _stream, entries in resp or [] for rid, fields in entries]


# -- one hop through the rlfleet path -------------------------------------------------------------
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
    entries = _entries(client.xreadgroup(GROUP, CONSUMER, {stream: ">"}, count=1, block=2000))
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
    entries = _entries(await client.xreadgroup(GROUP, CONSUMER, {stream: ">"}, count=1, block=2000))
    t2 = time.perf_counter()
    if len(entries) != 1:
        raise RuntimeError(f"expected 1 entry on {stream}, got {len(entries)}")
    rid, got = entries[0]
    data = got[b"data"]
    await client.xack(stream, GROUP, rid)
    t3 = time.perf_counter()
    return {"latency": t2 - t0, "cycle": t3 - t0, "publish": t1 - t0, "read": t2 - t1, "ack": t3 - t2,
            "bytes": float(len(data))}, rid


# -- the Redis side of the run --------------------------------------------------------------------
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


def _aof_rewrites(client: redis.Redis) -> int | None:
    info: Any = client.info("persistence")
    value = info.get("aof_rewrites")
    return None if value is None else int(value)


async def _reset(c: Clients, streams: Sequence[str], groups: Sequence[str] = (GROUP,)) -> None:
    """Empty the streams, recreate the groups, and let any AOF rewrite finish."""
    c.sync.delete(*streams)
    for stream in streams:
        await c.bus.ensure_groups(stream, list(groups))
    _wait_aof_idle(c.sync)


def _collect(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return out


def _latency_report(rows: list[dict[str, float]]) -> dict[str, Any]:
    cols = _collect(rows)
    size = cols.pop("bytes", [0.0])
    mean_bytes = sum(size) / len(size)
    cycle_total = sum(cols.get("cycle", []))
    seq_bps = len(rows) / cycle_total if cycle_total else math.nan
    return {
        "latency_ms": summary_ms(cols.get("latency", [])),
        "parts_ms": {k: summary_ms(v) for k, v in cols.items() if k not in ("latency",)},
        "bytes_mean": mean_bytes,
        "batches_per_s_sequential": seq_bps,
        "mb_per_s_sequential": seq_bps * mean_bytes / MB,
        "samples_s": cols,
    }


async def measure_latency(c: Clients, batch: Batch, payload: bytes, n: int, warmup: int) -> dict[str, Any]:
    """The three paths, one batch in flight, interleaved (rotating order) so that they share every
    disturbance (AOF fsync, rewrites, other load). Entries are deleted after each sample, outside the
    timed region, so the stream stays one entry long."""
    await _reset(c, list(c.streams.values()))
    rows: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    fields = raw_fields("b0:bench", payload)
    verified: dict[str, bool] = {}
    for i in range(warmup + n):
        shift = i % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            stream = c.streams[path]
            if path == "rlfleet":
                timing, mid, decoded = await rlfleet_hop(
                    c.bus, stream, GROUP,
                    encode=partial(encode_rollout, batch, f"b{i}:bench"),
                    decode=partial(decode_rollout, max_bytes=c.max_bytes),
                    headers={"kind": "rollout", "batch_id": f"b{i}:bench"},
                )
                if path not in verified:
                    verified[path] = isinstance(decoded, Rollout) and same_rollout(decoded, batch.rollout)
                c.sync.xdel(stream, mid)
            elif path == "raw_sync":
                timing, rid = raw_sync_hop(c.sync, stream, fields)
                c.sync.xdel(stream, rid)
            else:
                timing, rid = await raw_async_hop(c.aio, stream, fields)
                c.sync.xdel(stream, rid)
            if i >= warmup:
                rows[path].append(timing)
    if not verified.get("rlfleet"):
        raise RuntimeError("the decoded Rollout differs from the one that was published")
    return {p: _latency_report(rows[p]) for p in PATHS}


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
            for rid, fields in _entries(resp):
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
            for rid, _fields in _entries(resp):
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
        await _reset(c, [c.streams[path]])
        await runs[path](max(warmup, k))
    before = _aof_rewrites(c.sync)
    for r, m in enumerate(sizes):
        shift = r % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            await _reset(c, [c.streams[path]])
            passes[path].append(await runs[path](m))
    after = _aof_rewrites(c.sync)
    await _reset(c, list(c.streams.values()))
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


def measure_codec(batch: Batch, n: int, warmup: int, max_bytes: int) -> dict[str, Any]:
    """encode (rollout_to_proto + SerializeToString) and decode (parse_message +
    validate_rollout_batch) with no Redis in between."""
    enc: list[float] = []
    dec: list[float] = []
    size = 0
    for i in range(warmup + n):
        t0 = time.perf_counter()
        data = encode_rollout(batch, f"b{i}:codec")
        t1 = time.perf_counter()
        decode_rollout(data, max_bytes)
        t2 = time.perf_counter()
        size = len(data)
        if i >= warmup:
            enc.append(t1 - t0)
            dec.append(t2 - t1)
    both = [a + b for a, b in zip(enc, dec, strict=True)]
    return {"bytes": size, "encode_ms": summary_ms(enc), "decode_ms": summary_ms(dec),
            "encode_decode_ms": summary_ms(both), "samples_s": {"encode": enc, "decode": dec}}


async def measure_rtt(c: Clients, n: int) -> dict[str, Any]:
    """Redis round trip (PING) through the sync and asyncio clients, interleaved: the per-command
    floor that small messages pay three times per hop (XADD, XREADGROUP, XACK)."""
    rows: dict[str, list[float]] = {"sync": [], "async": []}
    for i in range(n + 10):
        t0 = time.perf_counter()
        c.sync.ping()
        t1 = time.perf_counter()
        await c.aio.ping()
        t2 = time.perf_counter()
        if i >= 10:
            rows["sync"].append(t1 - t0)
            rows["async"].append(t2 - t1)
    return {"ping_ms": {k: summary_ms(v) for k, v in rows.items()}, "samples_s": rows}


# -- the tiny run ---------------------------------------------------------------------------------
async def measure_tiny(c: Clients, cfg: BenchConfig) -> dict[str, Any]:
    """The tiny run's messages through the full rlfleet path, one in flight: PromptBatch
    (controller -> actor), RolloutBatch (actor -> each stage and the controller), ScoreBatch per
    stage (stage -> controller). Per step the run moves, per prompt message, 1 PromptBatch, 1
    RolloutBatch delivered to (stages + controller) groups and 1 ScoreBatch per stage."""
    run_cfg = load_config(ROOT / cfg.tiny_config)
    stages = [str(s) for s in run_cfg.stages()]
    g = run_cfg.algo.group_size
    seqs = run_cfg.batch.prompts_per_message * g
    r = run_cfg.generation.max_new_tokens
    msgs_per_step = run_cfg.batch.prompts_per_step // run_cfg.batch.prompts_per_message
    batch = make_batch(seqs, cfg.tiny_prompt_len, r, g, seed=cfg.seed + 1)
    ro = batch.rollout
    prompt_lists = [ro.prompt_ids[i][ro.prompt_mask[i]].tolist() for i in range(seqs)]
    group_list = ro.group_ids.tolist()
    score_tensors = {s: torch.rand(seqs) if s == "reward" else -torch.rand(seqs, r) for s in stages}
    keys = c.bus.keys
    max_bytes = c.max_bytes

    def encode_prompts(bid: str) -> bytes:
        msg = wire.message(pb.PromptBatch, batch_id=bid, version=0, sampling=batch.sampling, step=0)
        for i, tid in enumerate(ro.task_ids):
            msg.prompts.add(task_id=tid, token_ids=prompt_lists[i], dataset_index=group_list[i],
                            sample_index=i % g, group_id=group_list[i])
        return msg.SerializeToString()

    def decode_prompts(data: bytes) -> list[list[int]]:
        msg = wire.parse_message(pb.PromptBatch, data, max_bytes=max_bytes)
        return [list(p.token_ids) for p in msg.prompts]

    def encode_score(stage: str, bid: str) -> bytes:
        return wire.score_to_proto(bid, stage, ro.task_ids, score_tensors[stage], version=0,
                                   score_seconds=0.01).SerializeToString()

    def decode_score(stage: str, data: bytes) -> wire.Scores:
        sb = wire.parse_message(pb.ScoreBatch, data, max_bytes=max_bytes)
        return wire.score_from_proto(sb, max_bytes=max_bytes, expected_stage=stage, expected_rows=seqs,
                                     expected_cols=None if stage == "reward" else r)

    await _reset(c, [keys.prompts], ["actor"])
    await _reset(c, [keys.rollouts, c.streams["raw_sync"], c.streams["raw_async"]], [GROUP])
    await _reset(c, [keys.scores], ["controller"])
    rows: dict[str, list[dict[str, float]]] = {"prompt": [], "rollout": []}
    rows.update({f"score_{s}": [] for s in stages})
    # The floor: the tiny RolloutBatch's bytes (serialized once) through raw redis-py, same server.
    raw_rows: dict[str, list[dict[str, float]]] = {"raw_sync": [], "raw_async": []}
    tiny_fields = raw_fields("b0:tiny", encode_rollout(batch, "b0:tiny"))
    warmup = max(3, cfg.warmup)
    for i in range(warmup + cfg.tiny_hops):
        pbid = f"b{i * run_cfg.batch.prompts_per_message}"
        rid = f"{pbid}:tiny{i:04d}"
        hops: list[tuple[str, str, str, Callable[[], bytes], Callable[[bytes], object], dict[str, str]]] = [
            ("prompt", keys.prompts, "actor", partial(encode_prompts, pbid), decode_prompts,
             {"kind": "prompts", "batch_id": pbid}),
            ("rollout", keys.rollouts, GROUP, partial(encode_rollout, batch, rid),
             partial(decode_rollout, max_bytes=max_bytes), {"kind": "rollout", "batch_id": rid}),
        ]
        for s in stages:
            hops.append((f"score_{s}", keys.scores, "controller",
                         partial(encode_score, s, rid), partial(decode_score, s),
                         {"kind": "score", "stage": s, "batch_id": rid}))
        for name, stream, group, enc, dec, headers in hops:
            timing, mid, _ = await rlfleet_hop(c.bus, stream, group, enc, dec, headers)
            c.sync.xdel(stream, mid)
            if i >= warmup:
                rows[name].append(timing)
        timing, rid_ = raw_sync_hop(c.sync, c.streams["raw_sync"], tiny_fields)
        c.sync.xdel(c.streams["raw_sync"], rid_)
        timing_a, rid_ = await raw_async_hop(c.aio, c.streams["raw_async"], tiny_fields)
        c.sync.xdel(c.streams["raw_async"], rid_)
        if i >= warmup:
            raw_rows["raw_sync"].append(timing)
            raw_rows["raw_async"].append(timing_a)

    hop = {name: _latency_report(v) for name, v in rows.items()}
    p50 = {name: h["latency_ms"]["p50"] for name, h in hop.items()}

    def part(name: str, *parts: str) -> float:
        return sum(hop[name]["parts_ms"][q]["p50"] for q in parts)

    rollout_deliveries = len(stages) + 1  # every stage's group and the controller's
    score_names = [f"score_{s}" for s in stages]
    # Serial: every transport operation of one prompt message, one after another (acks included):
    # the PromptBatch hop, the RolloutBatch encoded and published once and read + decoded + acked by
    # each of its groups, and each stage's ScoreBatch hop.
    per_message_ms = (part("prompt", "cycle") + part("rollout", "encode", "publish")
                      + rollout_deliveries * part("rollout", "read", "decode", "ack")
                      + sum(part(n, "cycle") for n in score_names))
    # Critical path when the stages overlap: the prompt hop, the rollout hop and the slowest stage's
    # score hop (acks happen off that path).
    critical_ms = p50["prompt"] + p50["rollout"] + max((p50[n] for n in score_names), default=0.0)
    # The same deliveries if every message were moved by raw redis-py with no codec (all tiny
    # messages are a few KB, so the rollout-sized raw hop stands for each of them).
    raw = {name: _latency_report(v) for name, v in raw_rows.items()}
    floor: dict[str, float] = {}
    for name, rep_ in raw.items():
        q = {k: v["p50"] for k, v in rep_["parts_ms"].items()}
        per_msg = ((1 + len(stages)) * q["cycle"] + q["publish"]
                   + rollout_deliveries * (q["read"] + q["ack"]))
        floor[name] = msgs_per_step * per_msg
    return {
        "config": cfg.tiny_config,
        "stages": stages,
        "seqs_per_message": seqs,
        "prompt_len": cfg.tiny_prompt_len,
        "response_len": r,
        "messages_per_step": msgs_per_step,
        "deliveries_per_step": {
            "prompt": msgs_per_step,
            "rollout": msgs_per_step * rollout_deliveries,
            "score": msgs_per_step * len(stages),
        },
        "bytes": {name: h["bytes_mean"] for name, h in hop.items()},
        "hop_p50_ms": p50,
        "hops": hop,
        "transport_per_message_ms": per_message_ms,
        "transport_per_step_ms": msgs_per_step * per_message_ms,
        "transport_per_message_critical_ms": critical_ms,
        "transport_per_step_critical_ms": msgs_per_step * critical_ms,
        "raw_rollout_hops": raw,
        "raw_rollout_hop_p50_ms": {name: r_["latency_ms"]["p50"] for name, r_ in raw.items()},
        "raw_floor_per_step_ms": floor,
        "note": "transport_per_step_ms: every transport operation of a step one after another (sum of"
                " part medians, acks included, no overlap between stages or with generation): the"
                " conservative figure. *_critical_ms: the stages overlap, messages still one after another.",
    }


# -- the tiny run's step time (the local loop) ----------------------------------------------------
_LOCAL_CHILD: Final = """
import sys
from services.core.config.run import load_config
from services.local import run_local
config, steps, run_dir = sys.argv[1:4]
print(run_local(load_config(config, run__max_steps=int(steps), run__dir=run_dir, task__eval_size=0)))
"""


def _children_cpu_s() -> CpuSeconds:
    """CPU seconds (user, system) of this process's waited-for children (the local loop's child,
    once it ended)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime, ru.ru_stime


def _skipped(reason: str, **extra: Any) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, **extra}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "(no output)"


def measure_local_step(cfg: BenchConfig) -> dict[str, Any]:
    """Run the tiny run's local loop for `local_steps` steps in a child process (bounded by
    `local_timeout_s`; evaluation off, it is not part of a step; the policy is built in the
    temporary run dir as a fresh run does) and read `step_s` from the metrics.jsonl it writes. The
    first `local_warmup_steps` steps pay one-off costs (lazy kernel set-up, first backward pass) and
    are kept in the samples but left out of the median."""
    if not cfg.local_loop:
        return _skipped("disabled (--no-local)")
    config = ROOT / cfg.tiny_config
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-local-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-c", _LOCAL_CHILD, str(config), str(cfg.local_steps), str(run_dir)]
        t0 = time.perf_counter()
        cpu0, child0 = cpu_times(), _children_cpu_s()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.local_timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            return _skipped(f"the local loop did not finish {cfg.local_steps} steps within "
                            f"{cfg.local_timeout_s:g} s (raise --local-timeout)")
        wall = time.perf_counter() - t0
        child1 = _children_cpu_s()
        cpu = cpu_usage(cpu0, cpu_times(), (child1[0] - child0[0], child1[1] - child0[1]))
        if proc.returncode != 0:
            return _skipped(f"the local loop failed (exit {proc.returncode}): {_last_line(proc.stderr)}")
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            return _skipped(f"the local loop wrote no {metrics.name}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return _skipped("the local loop's metrics.jsonl is empty")
    skip = cfg.local_warmup_steps if len(rows) > cfg.local_warmup_steps else 0
    cols = {k: [float(r[k]) for r in rows if k in r] for k in ("step_s", "generate_s", "score_s", "train_s")}
    return {
        "status": "ok",
        "config": cfg.tiny_config,
        "steps": len(rows),
        "warmup_steps_excluded": skip,
        "wall_s": wall,
        "cpu": cpu,
        **{f"{k}_p50": median(v[skip:]) for k, v in cols.items()},
        **{f"{k}_samples": v for k, v in cols.items()},
        "note": "wall_s includes the child's imports and the model build; step_s is the loop's own timing"
                " (generate + score + train + weight sync of one step); medians leave out the warm-up steps",
    }


# -- host and server ------------------------------------------------------------------------------
def cpu_times() -> dict[str, int] | None:
    """Aggregate CPU jiffies from /proc/stat (Linux), to report busy and steal time over the run."""
    try:
        with open("/proc/stat") as f:
            head = f.readline().split()
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    if not head or head[0] != "cpu":
        return None
    return {name: int(v) for name, v in zip(names, head[1:], strict=False)}


CpuSeconds = tuple[float, float]  # (user, system)


def process_cpu_s(pid: int | None = None) -> CpuSeconds | None:
    """CPU seconds (user, system; all threads) of this process or of `pid`, from /proc."""
    if pid is None:
        t = os.times()
        return t.user, t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, IndexError, ValueError):
        return None


def cpu_usage(
    before: dict[str, int] | None, after: dict[str, int] | None, own: CpuSeconds | None
) -> dict[str, float] | None:
    """Shares of all CPUs' time between two `cpu_times()`: `busy` (not idle/iowait), `kernel`
    (system + irq + softirq: loopback networking and AOF writeback, mostly ours), `steal` (time the
    hypervisor gave to other guests), `own` (this benchmark and its redis-server, or the local
    loop's child) and `others_user`: user time of other processes, i.e. other work competing for
    the CPUs while we measured (`others`: all busy time that is not `own`, kernel work included)."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in before}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = 1.0 - (d.get("idle", 0) + d.get("iowait", 0)) / total
    out = {
        "busy": busy,
        "kernel": (d.get("system", 0) + d.get("irq", 0) + d.get("softirq", 0)) / total,
        "steal": d.get("steal", 0) / total,
    }
    if own is not None:
        tick = os.sysconf("SC_CLK_TCK")
        out["own"] = (own[0] + own[1]) * tick / total
        out["others"] = max(0.0, busy - out["own"])
        out["others_user"] = max(0.0, (d.get("user", 0) + d.get("nice", 0)) / total - own[0] * tick / total)
    return out


def wait_for_quiet_host(max_wait_s: float, busy_below: float = 0.10, window_s: float = 2.0) -> float | None:
    """Wait (up to `max_wait_s`) until the host's CPUs are less than `busy_below` busy over a
    `window_s` window, so that other processes do not land in the measurement. Returns the busy
    share of the last window (None where /proc/stat is unavailable)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = cpu_times()
        time.sleep(window_s)
        usage = cpu_usage(before, cpu_times(), None)
        if usage is None:
            return None
        if usage["busy"] < busy_below or time.monotonic() >= deadline:
            return usage["busy"]
        _progress(f"host CPUs {usage['busy']:.0%} busy with other work; waiting for a quiet host")


def _fs_type(path: Path) -> str:
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_info() -> dict[str, Any]:
    from google.protobuf import __version__ as protobuf_version
    from google.protobuf.internal import api_implementation

    try:
        import hiredis  # type: ignore[import-not-found]

        hiredis_version: str | None = str(hiredis.__version__)
    except ImportError:
        hiredis_version = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "protobuf": protobuf_version,
        "protobuf_backend": api_implementation.Type(),
        "redis_py": redis.__version__,
        "hiredis": hiredis_version,
    }


def redis_info(client: redis.Redis, data_dir: Path) -> dict[str, Any]:
    server: Any = client.info("server")
    conf: Any = client.config_get("*")
    return {
        "version": server.get("redis_version"),
        "appendonly": conf.get("appendonly"),
        "appendfsync": conf.get("appendfsync"),
        "maxmemory_policy": conf.get("maxmemory-policy"),
        "bind": conf.get("bind"),
        "data_dir_fs": _fs_type(data_dir),
    }


# -- the run --------------------------------------------------------------------------------------
async def _measure_redis(cfg: BenchConfig, rp: RedisProcess) -> dict[str, Any]:
    flow = FlowSection()  # the production defaults: message limit, deliveries, reclaim idle time
    bus = await Bus.connect(rp.url, RUN, max_message_bytes=flow.max_message_bytes,
                            max_deliveries=flow.max_deliveries, reclaim_idle_ms=flow.reclaim_idle_ms)
    sync = redis.Redis.from_url(rp.url, protocol=2)
    aio = aioredis.Redis.from_url(rp.url, protocol=2)
    try:
        streams = {"rlfleet": bus.keys.rollouts, "raw_sync": f"{RUN}:raw-sync",
                   "raw_async": f"{RUN}:raw-async"}
        c = Clients(bus=bus, sync=sync, aio=aio, streams=streams)
        server = redis_info(sync, rp.dir)
        rewrites0 = _aof_rewrites(sync)

        batch = make_batch(cfg.seqs, cfg.prompt_len, cfg.response_len, cfg.group_size, seed=cfg.seed)
        payload = encode_rollout(batch, "b0:bench")
        ro = batch.rollout
        proto = wire.rollout_to_proto(ro, "b0:bench", sampling=batch.sampling,
                                      finish_reasons=batch.finish_reasons)
        tensors = {name: len(getattr(proto, name).data) for name in TENSORS}
        shape = {"seqs": cfg.seqs, "prompt_len": cfg.prompt_len, "response_len": cfg.response_len,
                 "group_size": cfg.group_size, "response_tokens": int(ro.response_mask.sum()),
                 "bytes": len(payload), "tensor_bytes": tensors}

        _progress(f"latency: {cfg.batches} batches of {len(payload) / MB:.2f} MB per path, one in flight")
        latency = await measure_latency(c, batch, payload, cfg.batches, cfg.warmup)
        _progress(f"throughput: {cfg.batches} batches per path, {cfg.in_flight} in flight")
        throughput = await measure_throughput(c, batch, payload, cfg.batches, cfg.in_flight, cfg.warmup,
                                              cfg.rounds)
        _progress("codec only")
        codec = measure_codec(batch, cfg.batches, cfg.warmup, c.max_bytes)
        _progress(f"tiny run messages: {cfg.tiny_hops} hops of each kind")
        rtt = await measure_rtt(c, 2 * cfg.tiny_hops)
        tiny = await measure_tiny(c, cfg)
        rewrites1 = _aof_rewrites(sync)
        server["aof_rewrites_during_run"] = (
            None if rewrites0 is None or rewrites1 is None else rewrites1 - rewrites0)
        return {"redis": server, "payload": shape, "latency": latency, "throughput": throughput,
                "codec": codec, "rtt": rtt, "tiny": tiny}
    finally:
        await bus.close()
        await aio.aclose()
        sync.close()


def _ratios(res: dict[str, Any]) -> dict[str, float]:
    lat = res["latency"]
    tp = res["throughput"]
    out: dict[str, float] = {}
    ours = lat["rlfleet"]["latency_ms"]
    for peer in ("raw_sync", "raw_async"):
        out[f"latency_p50_rlfleet_over_{peer}"] = ours["p50"] / lat[peer]["latency_ms"]["p50"]
        out[f"latency_p99_rlfleet_over_{peer}"] = ours["p99"] / lat[peer]["latency_ms"]["p99"]
        out[f"throughput_rlfleet_over_{peer}"] = tp["rlfleet"]["batches_per_s"] / tp[peer]["batches_per_s"]
    codec_p50 = res["codec"]["encode_ms"]["p50"] + res["codec"]["decode_ms"]["p50"]
    out["codec_share_of_rlfleet_latency_p50"] = codec_p50 / lat["rlfleet"]["latency_ms"]["p50"]
    return out


def _own_cpu_s(rp: RedisProcess) -> CpuSeconds | None:
    """CPU seconds (user, system) used so far by this process and its redis-server together."""
    mine, server = process_cpu_s(), process_cpu_s(rp.proc.pid)
    return None if mine is None or server is None else (mine[0] + server[0], mine[1] + server[1])


def run_benchmark(
    cfg: BenchConfig, out: Path | None = None, *, quick: bool = False, wait_quiet_s: float = 0.0
) -> dict[str, Any]:
    """Start Redis, measure, stop Redis, run the local loop, assemble (and write) the results."""
    host = host_info()
    if wait_quiet_s > 0:
        host["busy_before_start"] = wait_for_quiet_host(wait_quiet_s)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-redis-") as tmp:
        rp = start_redis(Path(tmp) / "redis", appendfsync="everysec")
        try:
            cpu0, own0 = cpu_times(), _own_cpu_s(rp)
            res = asyncio.run(asyncio.wait_for(_measure_redis(cfg, rp), REDIS_PHASES_TIMEOUT_S))
            own1 = _own_cpu_s(rp)
            own = None if own0 is None or own1 is None else (own1[0] - own0[0], own1[1] - own0[1])
            host["cpu_during_redis_phases"] = cpu_usage(cpu0, cpu_times(), own)
        finally:
            rp.stop()
    if cfg.local_loop:
        _progress(f"tiny run step time: local loop, {cfg.local_steps} steps"
                  f" (limit {cfg.local_timeout_s:g} s)")
    local = measure_local_step(cfg)
    tiny = res["tiny"]
    if local["status"] == "ok":
        step_ms = local["step_s_p50"] * 1e3
        share = tiny["transport_per_step_ms"] / step_ms
        tiny["step_comparison"] = {
            "status": "ok", "local_step_p50_ms": step_ms, "transport_share": share,
            "transport_share_critical": tiny["transport_per_step_critical_ms"] / step_ms,
            "raw_floor_share": tiny["raw_floor_per_step_ms"]["raw_sync"] / step_ms,
            "target": TRANSPORT_TARGET, "meets_target": share < TRANSPORT_TARGET,
        }
    else:
        tiny["step_comparison"] = {"status": "skipped", "reason": local["reason"]}
    results: dict[str, Any] = {
        "benchmark": "data_plane",
        "format": 1,
        "mode": "quick" if quick else "full",
        "started_at": started.isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "host": host,
        **res,
        "ratios": _ratios(res),
        "local_loop": local,
    }
    results["wall_s"] = time.perf_counter() - t0
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    return results


# -- reporting ------------------------------------------------------------------------------------
def format_report(res: dict[str, Any]) -> str:
    pay = res["payload"]
    host = res["host"]
    srv = res["redis"]
    lat = res["latency"]
    tp = res["throughput"]
    k = res["config"]["in_flight"]
    n = res["config"]["batches"]
    lines = [
        f"rlfleet data plane: {pay['seqs']} seqs x ({pay['prompt_len']} prompt"
        f" + {pay['response_len']} response)"
        f" tokens, {pay['bytes'] / MB:.2f} MB per RolloutBatch, N={n}",
        f"redis {srv['version']} loopback, appendonly={srv['appendonly']} appendfsync={srv['appendfsync']}"
        f" ({srv['data_dir_fs']}); {host['cpus_usable']} CPUs ({host['cpu_model']}); python {host['python']},"
        f" redis-py {host['redis_py']}, protobuf {host['protobuf']} ({host['protobuf_backend']})",
        "",
        f"{'path':<22}{'p50 ms':>9}{'p99 ms':>9}{'seq b/s':>9}{f'b/s K={k}':>10}{f'MB/s K={k}':>11}",
    ]
    for path in PATHS:
        lm = lat[path]["latency_ms"]
        t = tp[path]
        lines.append(f"{PATH_LABELS[path]:<22}{lm['p50']:>9.2f}{lm['p99']:>9.2f}"
                     f"{lat[path]['batches_per_s_sequential']:>9.1f}{t['batches_per_s']:>10.1f}{t['mb_per_s']:>11.0f}")
    parts = lat["rlfleet"]["parts_ms"]
    lines.append("rlfleet p50 parts: " + ", ".join(
        f"{p} {parts[p]['p50']:.2f}" for p in ("encode", "publish", "read", "decode", "ack")) + " ms")
    r = res["ratios"]
    codec = res["codec"]
    lines += [
        "",
        *(f"ratio rlfleet/{label + ':':<12} latency p50 {r[f'latency_p50_rlfleet_over_{peer}']:.2f}x,"
          f" p99 {r[f'latency_p99_rlfleet_over_{peer}']:.2f}x,"
          f" throughput {r[f'throughput_rlfleet_over_{peer}']:.2f}x"
          for peer, label in (("raw_sync", "raw-sync"), ("raw_async", "raw-asyncio"))),
        f"codec only (no Redis): encode {codec['encode_ms']['p50']:.2f}"
        f" + decode {codec['decode_ms']['p50']:.2f} ms"
        f" p50 = {r['codec_share_of_rlfleet_latency_p50']:.0%} of rlfleet p50 latency",
    ]
    tiny = res["tiny"]
    raw_hop = tiny["raw_rollout_hop_p50_ms"]
    ping = res["rtt"]["ping_ms"]
    d = tiny["deliveries_per_step"]
    hop = tiny["hop_p50_ms"]
    lines += [
        "",
        f"tiny run ({tiny['config']}: {tiny['seqs_per_message']} seqs/message, prompt {tiny['prompt_len']},"
        f" response {tiny['response_len']}, stages {'+'.join(tiny['stages'])}): hop p50 "
        + ", ".join(f"{name} {v:.2f} ms ({tiny['bytes'][name]:.0f} B)" for name, v in hop.items()),
        "  raw redis-py hop of the same RolloutBatch bytes: p50 "
        + ", ".join(f"{name.replace('_', '-')} {v:.2f} ms" for name, v in raw_hop.items())
        + f"; Redis round trip (PING) p50 sync {ping['sync']['p50'] * 1e3:.0f} us,"
          f" asyncio {ping['async']['p50'] * 1e3:.0f} us",
        f"  per step: {d['prompt']} prompt + {d['rollout']} rollout + {d['score']} score deliveries"
        f" = {tiny['transport_per_step_ms']:.1f} ms serial"
        f" ({tiny['transport_per_step_critical_ms']:.1f} ms if stages overlap);"
        f" raw-sync floor for the same deliveries {tiny['raw_floor_per_step_ms']['raw_sync']:.1f} ms",
    ]
    cmp_ = tiny["step_comparison"]
    if cmp_["status"] == "ok":
        verdict = "yes" if cmp_["meets_target"] else "NO"
        lines.append(f"  local-loop step p50 {cmp_['local_step_p50_ms']:.0f} ms -> transport adds"
                     f" {cmp_['transport_share']:.1%} (< {TRANSPORT_TARGET:.0%}: {verdict});"
                     f" {cmp_['transport_share_critical']:.1%} if stages overlap")
    else:
        lines.append(f"  local-loop step time: skipped: {cmp_['reason']}")
    lines.append(f"wall {res['wall_s']:.1f} s")
    phases = {"Redis phases": host.get("cpu_during_redis_phases"), "local loop": res["local_loop"].get("cpu")}
    for phase, cpu in phases.items():
        if not cpu:
            continue
        line = f"{phase}: host CPUs {cpu['busy']:.0%} busy"
        if "others" in cpu:
            line += (f" ({cpu['own']:.0%} ours, {cpu['others_user']:.0%} user time of other processes,"
                     f" kernel {cpu['kernel']:.0%} all told)")
        lines.append(line + f", steal {cpu['steal']:.1%}")
        if cpu.get("others_user", 0.0) > NOISY_HOST:
            lines.append(f"WARNING: other processes used the CPUs during the {phase}; rerun on a quiet host")
    return "\n".join(lines)


def _progress(msg: str) -> None:
    print(f"[data_plane] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, Path, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m bench.data_plane",
                                 description="CPU benchmark of the rlfleet data plane against raw redis-py")
    ap.add_argument("--quick", action="store_true",
                    help="10 batches, fewer tiny hops, 2 local steps (< 15 s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default: bench/results/data_plane-<UTC stamp>[-quick].json)")
    ap.add_argument("--batches", type=int, help="measured batches per path and mode")
    ap.add_argument("--in-flight", type=int, help="batches in flight in the throughput mode")
    ap.add_argument("--rounds", type=int, help="throughput passes per path (the paths take turns)")
    ap.add_argument("--seqs", type=int, help="sequences per RolloutBatch")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--response-len", type=int)
    ap.add_argument("--tiny-hops", type=int, help="measured hops of each tiny-run message kind")
    ap.add_argument("--no-local", action="store_true", help="skip the local-loop step time")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for the host's CPUs to be < 10%% busy (shared hosts)")
    ap.add_argument("--local-steps", type=int)
    ap.add_argument("--local-timeout", type=float, help="seconds allowed for the local loop")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else BenchConfig()
    overrides = {
        "batches": args.batches, "in_flight": args.in_flight, "rounds": args.rounds, "seqs": args.seqs,
        "prompt_len": args.prompt_len, "response_len": args.response_len, "tiny_hops": args.tiny_hops,
        "local_steps": args.local_steps, "local_timeout_s": args.local_timeout,
    }
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.no_local:
        cfg = replace(cfg, local_loop=False)
    positive = ("batches", "in_flight", "rounds", "seqs", "prompt_len", "response_len", "tiny_hops",
                "local_steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    out = args.out
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = ROOT / "bench" / "results" / f"data_plane-{stamp}{'-quick' if args.quick else ''}.json"
    return cfg, out, args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out, args = parse_args(argv)
    res = run_benchmark(cfg, out, quick=bool(args.quick), wait_quiet_s=float(args.wait_quiet))
    print(format_report(res))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
