"""One-H200 check of engine replicas (issue 15): two vLLM engine replicas in one actor share the GPU
(memory split), both receive each weight sync, and both score like the trainer.

    python -m bench.replica_check --out DIR          # on the GPU host (vLLM installed)
    python -m bench.replica_check --out DIR --transfer collective   # weights by broadcast (gloo, staged)
    python -m bench.replica_check --out DIR --transfer collective --sweep-mb 16,64,256   # + sync s per bucket size
    BENCH_DRY=1 python -m bench.replica_check --out DIR   # CPU dry run of the script (transformers engine)

It drives exactly the actor's path: `make_engine(..., replicas=2, **generation.engine_kwargs())` builds
a `ReplicaEngine` of two `ProcessEngine`s, each a child process pinned by CUDA_VISIBLE_DEVICES to the
one GPU with `gpu_memory_utilization / 2`; weights go in by `update_weights` (CUDA IPC from the
trainer's tensors), as in `Actor._train_step`. `--transfer collective` sends them instead as replicas
on GPUs of their own get them, by broadcast streamed into vLLM bucket by bucket; on one GPU the
backend is gloo (NCCL refuses two processes on one device), so this checks the streaming load, not
NCCL. A Qwen2.5-0.5B-shaped model with random weights (bf16)
is the policy; after each of 3 syncs (a few AdamW steps on a fixed text in between, so the model
turns peaked) it records, per replica:

- its version (each replica's own, read from its process), so "both received the sync";
- the max / mean |engine log-prob - trainer log-prob| over its rows of a seeded batch (the trainer's
  `response_logprobs` on the same tokens, bf16 and fp32 forwards), so "both score like the trainer";
- greedy completions of the same prompts on both replicas (the prompt set twice, one copy per
  replica): equal when both hold the same weights;
- the GPU memory its process holds (NVML) against the GPU's total, so "they share it, split";
- whether every parameter it holds has the trainer's checksum (`services.models.weights.check`: exact
  integer sums of the bytes in the engine's dtype, vLLM's fused q/k/v and gate/up as their parts), so
  "both hold exactly the trainer's weights" is checked directly, not through greedy text (issue 34).
  A mismatch fails the sync (the replica is stopped): the round records the replica, the parameter
  and both checksums, and the check ends there.

Writes DIR/replica-check.json; exit 1 when a check fails (thresholds as in bench/vllm_check.py:
log-prob max diff <= 0.1 bf16, equal versions, equal greedy completions, equal checksums on every
replica with none unpaired, each replica under its share).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import say

REPO = Path(__file__).resolve().parents[1]
DRY = os.environ.get("BENCH_DRY") == "1"
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/replica-check-work"))
SHAPE: dict[str, Any] = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1,
                             eos_token_id=2)
BATCH, PROMPT_LEN, NEW_TOKENS, SYNCS, UTIL = 64, 32, 64, 3, 0.7
if DRY:
    SHAPE.update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64, vocab_size=512)
    BATCH, PROMPT_LEN, NEW_TOKENS, SYNCS = 8, 6, 4, 2
MAX_LOGPROB_DIFF = 0.1


def build_model(path: Path) -> Path:
    """A random Qwen2 of SHAPE saved with a minimal tokenizer config (no hub access)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.models.roles.tokenizer import SPECIAL_TOKENS, build_tokenizer_from_vocab

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model: Any = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    model = model.to(torch.float32 if DRY else torch.bfloat16)
    model.save_pretrained(path)
    # <pad> <s> </s> <unk> are ids 0..3 (bos 1, eos 2 as in SHAPE), then one word per remaining id.
    words = [f"w{i}" for i in range(int(SHAPE["vocab_size"]) - len(SPECIAL_TOKENS))]
    build_tokenizer_from_vocab(words, "word").save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.replica_check")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--transfer", choices=["ipc", "collective"], default="ipc")
    ap.add_argument("--sweep-mb", default="",
                    help="collective: then time two syncs per bucket size (MiB, comma-separated)")
    a = ap.parse_args(argv)
    sweep = [int(x) for x in a.sweep_mb.split(",") if x.strip()]
    if sweep and a.transfer != "collective":
        ap.error("--sweep-mb needs --transfer collective (by-reference syncs have no buckets)")
    a.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    import torch

    from services.actor.engine_metrics import replica_rows
    from services.core.config.run import parse_config
    from services.core.observability.gpu import GpuMonitor
    from services.core.observability.metrics import ServiceMetrics
    from services.models.engine import SamplingParams
    from services.models.engines.factory import make_engine
    from services.models.engines.replicas import ReplicaEngine, spread
    from services.models.io.loading import load_causal_lm
    from services.models.nets.logprobs import response_logprobs
    from services.models.weights.check import WeightsMismatch

    device = "cpu" if DRY else "cuda"
    dtype = "float32" if DRY else "bfloat16"
    model_path = build_model(WORK / "model")
    gen = parse_config({"generation": {"engine": "transformers" if DRY else "vllm", "device": device,
                                       "replicas": 2, "weight_transfer": a.transfer,
                                       "weight_transfer_backend": "gloo" if a.transfer == "collective" else "auto",
                                       "vllm": {"gpu_memory_utilization": UTIL, "max_model_len": 512}}}).generation
    t0 = time.perf_counter()
    engine = make_engine(gen.engine, model_path, dtype=dtype, **gen.engine_kwargs())
    assert isinstance(engine, ReplicaEngine)
    say(f"2 replicas up in {time.perf_counter() - t0:.1f}s:", json.dumps(engine.describe(), default=str)[:400])
    policy: Any = load_causal_lm(model_path, dtype="float32", device=device)  # the trainer's copy, fp32 master
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    gpu = GpuMonitor(ServiceMetrics("actor")) if not DRY else None
    g = torch.Generator().manual_seed(0)
    hi = int(SHAPE["vocab_size"]) - 10
    half = [torch.randint(3, hi, (PROMPT_LEN,), generator=g).tolist() for _ in range(BATCH // 2)]
    prompts = half + half  # rows 0..B/2-1 on replica 0, the same prompts again on replica 1
    text = torch.randint(3, hi, (1, 128), generator=g).to(device)
    rounds: list[dict[str, Any]] = []
    ok = True
    for version in range(1, SYNCS + 1):
        for _ in range(5):  # a few SFT steps: the weights move and turn peaked
            loss = policy(input_ids=text, labels=text).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        t = time.perf_counter()
        try:
            engine.update_weights(policy.state_dict().items(), version)  # the actor's weight sync call
        except WeightsMismatch as err:  # a replica holds weights the trainer did not send: stopped
            sums = _checksums(engine, version, err)
            rounds.append({"version": version, "sync_s": round(time.perf_counter() - t, 3), "checksums": sums,
                           "error": str(err), "checks": {"checksums_equal": False}})
            say(f"version {version}: {err}")
            ok = False
            break
        sync_s = time.perf_counter() - t
        sums = _checksums(engine, version, None)
        versions = [int(r["version"]) for r in engine.replica_stats()]
        comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=version))
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
        per: list[dict[str, Any]] = []
        # The trainer scores in fp32 and (on the GPU) in bf16, a copy: the fp32 master stays as it is.
        forwards: dict[str, Any] = {"float32": policy}
        if not DRY:
            forwards["bfloat16"] = copy.deepcopy(policy).to(torch.bfloat16)
        for r, (lo, hi_) in enumerate(spread(len(prompts), 2)):
            diffs = {fwd: _logprob_diff(m, prompts[lo:hi_], comps[lo:hi_], device, response_logprobs)
                     for fwd, m in forwards.items()}
            per.append({"replica": r, "version": versions[r], "logprob_diff": diffs})
        same_greedy = [c.token_ids for c in greedy[:BATCH // 2]] == [c.token_ids for c in greedy[BATCH // 2:]]
        del forwards
        rows = replica_rows(engine, gpu)
        mem = [{"replica": x["replica"], "gpus": x.get("gpus", [])} for x in rows]
        checks = {"versions": versions == [version, version], "greedy_equal_across_replicas": same_greedy,
                  "checksums_equal": all(x["equal"] for x in sums),
                  "logprobs": all(d["max"] <= MAX_LOGPROB_DIFF for p in per for d in p["logprob_diff"].values())}
        ok = ok and all(checks.values())
        rounds.append({"version": version, "sync_s": round(sync_s, 3), "checksums": sums, "replicas": per,
                       "memory": mem, "checks": checks})
        say(f"version {version}: sync {sync_s:.2f}s, checks {checks}")
    swept: list[dict[str, Any]] = []
    version = SYNCS
    for mb in sweep if ok else []:
        for e in engine.engines:
            e.transfer_bucket_bytes = mb * 2**20  # type: ignore[attr-defined]
        for _ in range(2):  # the first sync of a size may grow the host buffers: the second is the figure
            version += 1
            t = time.perf_counter()
            engine.update_weights(policy.state_dict().items(), version)  # checksums checked: raises on a mismatch
            row = {"bucket_mb": mb, "version": version, "sync_s": round(time.perf_counter() - t, 3),
                   "replicas": [{k: round(float(v), 4) for k, v in (getattr(e, "last_sync", {}) or {}).items()}
                                for e in engine.engines]}
            swept.append(row)
            say(f"bucket {mb} MiB, version {version}: sync {row['sync_s']:.2f}s")
    total = torch.cuda.get_device_properties(0).total_memory if not DRY and torch.cuda.is_available() else None
    result = {"ok": ok, "dry": DRY, "replicas": 2, "weight_transfer": a.transfer, "gpu_memory_utilization": UTIL,
              "per_replica_share": UTIL / 2, "gpu_total_bytes": total, "rounds": rounds, "sweep": swept,
              "device": torch.cuda.get_device_name(0) if not DRY and torch.cuda.is_available() else "cpu",
              "describe": engine.describe()}
    engine.close()
    out = a.out / ("replica-check.json" if a.transfer == "ipc" else f"replica-check-{a.transfer}.json")
    out.write_text(json.dumps(result, indent=2, default=str))
    say("ok" if ok else "FAILED", "->", out)
    return 0 if ok else 1


def _checksums(engine: Any, version: int, err: Any) -> list[dict[str, Any]]:
    """Per replica, whether every parameter it holds after this sync has the trainer's checksum
    (`weights.check`: exact sums of the bytes in the engine's dtype, fused parameters as their parts):
    equal only when each tensor was compared (`checked`) and none was left unpaired either way."""
    out: list[dict[str, Any]] = []
    for r, e in enumerate(engine.engines):
        sync = dict(getattr(e, "last_sync", {}) or {})
        if err is not None and f"replica {r}:" in str(err):
            out.append({"replica": r, "equal": False, "parameter": err.parameter, "engine": list(err.held or ()),
                        "trainer": list(err.sent or ())})
        elif e.version != version:
            out.append({"replica": r, "equal": False, "synced": False})  # stopped before its turn
        else:
            checked, unpaired = int(sync.get("checksums_checked", 0)), int(sync.get("checksums_unpaired", -1))
            out.append({"replica": r, "equal": checked > 0 and unpaired == 0, "checked": checked,
                        "unpaired": unpaired, "seconds": round(float(sync.get("checksum_seconds", 0.0)), 4),
                        "sync_seconds": round(float(sync.get("seconds", 0.0)), 4)})
    return out


def _logprob_diff(model: Any, prompts: list[list[int]], comps: list[Any], device: str, fn: Any) -> dict[str, float]:
    import torch

    from services.models.engine import completions_to_rollout

    r = completions_to_rollout([str(i) for i in range(len(prompts))], prompts, comps, list(range(len(prompts))), 0, 0)
    with torch.no_grad():
        lp = fn(model, r.prompt_ids.to(device), r.prompt_mask.to(device), r.response_ids.to(device),
                r.response_mask.to(device), temperature=1.0).float().cpu()
    d = (lp - r.behaviour_logprobs).abs()[r.response_mask]
    if not d.numel():
        return {"max": 0.0, "mean": 0.0}
    return {"max": round(float(d.max()), 5), "mean": round(float(d.mean()), 6)}


if __name__ == "__main__":
    raise SystemExit(main())
