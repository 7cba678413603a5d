"""Latency with one batch in flight (the three paths interleaved sample by sample), the codec alone, and
Redis's round trip."""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any

from bench.data_plane.batches import Batch, decode_rollout, encode_rollout, raw_fields, same_rollout
from bench.data_plane.config import GROUP, MB, PATHS
from bench.data_plane.hops import Clients, raw_async_hop, raw_sync_hop, reset, rlfleet_hop
from bench.data_plane.stats import summary_ms
from services.rl.batch import Rollout


def _collect(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            out.setdefault(k, []).append(v)
    return out


def latency_report(rows: list[dict[str, float]]) -> dict[str, Any]:
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
    await reset(c, list(c.streams.values()))
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
    return {p: latency_report(rows[p]) for p in PATHS}


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
