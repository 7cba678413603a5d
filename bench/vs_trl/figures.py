"""The figures of `bench.vs_trl`'s report: the results of one or more calls merged, and per workload
the figures issue 16 asks for (medians and spread of the repeats, time to first step, the trainer's
model FLOP utilization, the per-step floor).

Model FLOPs (stated in BENCHMARKS.md): a sequence of T tokens (prompt + completion) costs, per token,
6·N + 12·L·d·T for a forward and backward pass and 2·N + 4·L·d·T for a forward pass, where N counts the
parameters that multiply activations (every linear layer of the L blocks plus the LM head; the embedding
lookup is free) and d is the hidden size (PaLM's accounting, causal masking not discounted). The trainer
runs one forward + backward of every sequence and, where it runs one (the `proximal_forward` metric:
several updates per batch), an extra no-grad forward for the proximal log-probs: MFU = those FLOPs /
(actor train seconds × 989 TFLOP/s, H200 bf16 dense). The per-step floor is generation at plain vLLM
speed (`vllm-alone`, no log-probs) plus the forward + backward at 50% MFU."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PEAK_FLOPS = 989e12  # H200 SXM bf16 dense
FLOOR_MFU = 0.5
STAGES = ("generate", "reference", "reward", "critic", "advantage", "actor_train", "critic_train", "weight_sync")
REPEATS = ("r1", "r2", "r3")
# TRL with vLLM runs more than once too: `trl-vllm-<w>`, then `-r2`, `-r3`. Its steady rate moved by 60%
# between two runs minutes apart on 2026-12-02 (57.2 and 35.6 samples/s at 0.5B), so a ratio needs
# its repeats; the headline takes its fastest run, so that "n times faster than TRL" holds against TRL
# at its best, and the ratio to the median of its runs is stated beside it.
PEER_REPEATS = ("", "-r2", "-r3")


def peer_names(w: str) -> list[str]:
    """The phases of TRL with vLLM on workload `w`, first run first."""
    return [f"trl-vllm-{w}{r}" for r in PEER_REPEATS]


def matmul_params(shape: dict[str, Any]) -> int:
    """Parameters that multiply activations: the blocks' linear layers and the LM head."""
    h, layers, inter, vocab = (int(shape[k]) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                      "vocab_size"))
    kv = int(shape["num_key_value_heads"]) * (h // int(shape["num_attention_heads"]))
    return layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + vocab * h


def train_flops(shape: dict[str, Any], sequences: float, seq_len: float, off_policy: float = 0.0) -> float:
    """Model FLOPs of one trainer step: forward + backward of every sequence, plus a forward of the
    share of steps whose trainer ran a separate proximal pass (`off_policy`)."""
    n, attn = matmul_params(shape), shape["num_hidden_layers"] * shape["hidden_size"] * seq_len
    tokens = sequences * seq_len
    return tokens * (6 * n + 12 * attn) + off_policy * tokens * (2 * n + 4 * attn)


def spread(values: list[float]) -> float | None:
    """(max - min) / median: how far apart the repeats are."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def merge(paths: list[Path]) -> dict[str, Any]:
    """One result from several calls: a phase measured in a later call replaces a failed or absent one,
    and a TRL-with-vLLM run measured again counts as its next repeat (`trl-vllm-0.5b` -> `-r2`), not as a
    replacement that would keep whichever run came last."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = {k: v for k, v in runs[0].items() if k not in ("phases", "gpu_samples")}
    out["commands"] = [r["command"] for r in runs]
    out["files"] = [Path(p).name for p in paths]
    out["phases"], out["gpu_samples"] = {}, []
    for r in runs:
        out["gpu_samples"] += r.get("gpu_samples") or []
        for name, ph in r["phases"].items():
            name = _peer_slot(name, ph, out["phases"])
            if _standing(ph) >= _standing(out["phases"].get(name, {})):
                out["phases"][name] = ph
    return out


def _peer_slot(name: str, ph: dict[str, Any], have: dict[str, Any]) -> str:
    """Where a measured run of a peer phase goes: its own name, or the first repeat not measured yet."""
    base = next((name[: -len(r)] for r in PEER_REPEATS[1:] if name.endswith(r)), name)
    if not (base.startswith("trl-vllm-") and ph.get("ok") and have.get(name, {}).get("ok")):
        return name
    return next((base + r for r in PEER_REPEATS if not have.get(base + r, {}).get("ok")), name)


def _standing(ph: dict[str, Any]) -> int:
    """Measured beats failed, and a phase that ran and failed beats a later skip: its reason is the real one."""
    return 2 if ph.get("ok") else 1 if "rc" in ph or "error" in ph else 0


def workload_summary(res: dict[str, Any], w: str) -> dict[str, Any]:
    """The figures of one workload: the peer, the three repeats, the floor and the targets' values."""
    ph, W = res["phases"], res["workload"]
    shape = res["shapes"][w]
    peers = [ph[n] for n in peer_names(w) if ph.get(n, {}).get("ok")]
    # The fastest run of the peer is the one the ratio is taken to; without any, the first run says why.
    peer = max(peers, key=lambda p: p["samples_per_s"]) if peers else ph.get(f"trl-vllm-{w}", {})
    reps = [ph[f"fleet-{w}-{r}"] for r in REPEATS if ph.get(f"fleet-{w}-{r}", {}).get("ok")]
    alone = ph.get(f"vllm-alone-{w}", {}).get("variants", {})
    s: dict[str, Any] = {"peer": peer, "peers": peers, "repeats": reps}
    if peers:
        s["peer_median"] = statistics.median(p["samples_per_s"] for p in peers)
        s["peer_spread"] = spread([p["samples_per_s"] for p in peers])
    # Nominal lengths where no repeat measured them: the floor is the workload's, measured or not.
    seqs = W["prompts_per_step"] * W["group"]
    seq_len = W["prompt_tokens"] + (statistics.median(p.get("response_len", W["completion_tokens"]) for p in reps)
                                    if reps else W["completion_tokens"])
    if reps:
        sps = [p["samples_per_s"] for p in reps]
        s["samples_per_s"] = statistics.median(sps)
        s["spread"] = spread(sps)
        s["step_s"] = statistics.median(p["median_step_s"] for p in reps)
        s["gpu_util"] = median_of([p.get("gpu_util") for p in reps])
        s["first_step_s"] = median_of([p.get("first_step_s") for p in reps])
        s["engine_start_s"] = median_of([p.get("engine_start_s") for p in reps])
        s["stages"] = {k: median_of([p.get("stages", {}).get(k) for p in reps]) for k in STAGES}
        train_s = median_of([p.get("train_s") for p in reps])
        off = statistics.fmean(p.get("proximal", p.get("off_policy", 0.0)) for p in reps)
        if train_s:
            s["mfu"] = train_flops(shape, seqs, seq_len, off) / (train_s * PEAK_FLOPS)
        s["generate_tokens_per_s"] = median_of([p.get("generate_tokens_per_s") for p in reps])
    plain = alone.get("plain", {}).get("tokens_per_s")
    if plain:
        gen_floor = seqs * (seq_len - W["prompt_tokens"]) / plain
        train_floor = train_flops(shape, seqs, seq_len) / (FLOOR_MFU * PEAK_FLOPS)
        s["floor"] = {"generate_s": gen_floor, "train_s": train_floor, "step_s": gen_floor + train_floor}
        if reps:
            s["floor_fraction"] = s["floor"]["step_s"] / s["step_s"]
    solo = ph.get(f"train-alone-{w}", {})
    if solo.get("ok"):
        # The same batch shape the repeats trained, with the GPU to itself; no proximal forward (one
        # optimizer step per batch, as in the repeats).
        t = {"train_s": solo["train_median_s"], "reference_s": solo["reference_median_s"],
             "mfu": train_flops(shape, seqs, W["prompt_tokens"] + W["completion_tokens"])
             / (solo["train_median_s"] * PEAK_FLOPS)}
        if plain:
            t["serial_step_s"] = seqs * W["completion_tokens"] / plain + t["train_s"] + t["reference_s"]
        s["alone"] = t
    if peer.get("ok") and reps:
        s["ratio"] = s["samples_per_s"] / peer["samples_per_s"]
        s["ratio_median"] = s["samples_per_s"] / s["peer_median"]
    return s


def median_of(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None
