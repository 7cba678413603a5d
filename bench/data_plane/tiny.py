"""The tiny CPU run's messages (PromptBatch, RolloutBatch, a ScoreBatch per stage) through the full
rlfleet path and the raw floor, added up to the deliveries of one training step."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench.data_plane.batches import decode_rollout, encode_rollout, make_batch, raw_fields
from bench.data_plane.config import GROUP, ROOT, BenchConfig
from bench.data_plane.hops import Clients, raw_async_hop, raw_sync_hop, reset, rlfleet_hop
from bench.data_plane.latency import latency_report
from services.core.config.run import load_config
from services.core.pb import rlfleet_pb2 as pb
from services.rl import wire


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

    await reset(c, [keys.prompts], ["actor"])
    await reset(c, [keys.rollouts, c.streams["raw_sync"], c.streams["raw_async"]], [GROUP])
    await reset(c, [keys.scores], ["controller"])
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

    hop = {name: latency_report(v) for name, v in rows.items()}
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
    raw = {name: latency_report(v) for name, v in raw_rows.items()}
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
