"""One run: start a private redis-server, measure every phase against it, stop it, run the local loop,
and assemble (and write) the results with their ratios."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from bench.data_plane.batches import encode_rollout, make_batch
from bench.data_plane.config import MB, REDIS_PHASES_TIMEOUT_S, RUN, TENSORS, TRANSPORT_TARGET, BenchConfig, say
from bench.data_plane.hops import Clients, aof_rewrites
from bench.data_plane.host import (
    CpuSeconds,
    cpu_times,
    cpu_usage,
    host_info,
    process_cpu_s,
    redis_info,
    wait_for_quiet_host,
)
from bench.data_plane.latency import measure_codec, measure_latency, measure_rtt
from bench.data_plane.local_loop import measure_local_step
from bench.data_plane.throughput import measure_throughput
from bench.data_plane.tiny import measure_tiny
from services.core.config.run import FlowSection
from services.core.host.redis_proc import RedisProcess, start_redis
from services.core.transport.bus import Bus
from services.rl import wire


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
        rewrites0 = aof_rewrites(sync)

        batch = make_batch(cfg.seqs, cfg.prompt_len, cfg.response_len, cfg.group_size, seed=cfg.seed)
        payload = encode_rollout(batch, "b0:bench")
        ro = batch.rollout
        proto = wire.rollout_to_proto(ro, "b0:bench", sampling=batch.sampling,
                                      finish_reasons=batch.finish_reasons)
        tensors = {name: len(getattr(proto, name).data) for name in TENSORS}
        shape = {"seqs": cfg.seqs, "prompt_len": cfg.prompt_len, "response_len": cfg.response_len,
                 "group_size": cfg.group_size, "response_tokens": int(ro.response_mask.sum()),
                 "bytes": len(payload), "tensor_bytes": tensors}

        say(f"latency: {cfg.batches} batches of {len(payload) / MB:.2f} MB per path, one in flight")
        latency = await measure_latency(c, batch, payload, cfg.batches, cfg.warmup)
        say(f"throughput: {cfg.batches} batches per path, {cfg.in_flight} in flight")
        throughput = await measure_throughput(c, batch, payload, cfg.batches, cfg.in_flight, cfg.warmup,
                                              cfg.rounds)
        say("codec only")
        codec = measure_codec(batch, cfg.batches, cfg.warmup, c.max_bytes)
        say(f"tiny run messages: {cfg.tiny_hops} hops of each kind")
        rtt = await measure_rtt(c, 2 * cfg.tiny_hops)
        tiny = await measure_tiny(c, cfg)
        rewrites1 = aof_rewrites(sync)
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
        say(f"tiny run step time: local loop, {cfg.local_steps} steps"
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
