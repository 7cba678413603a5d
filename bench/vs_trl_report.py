"""The report of `bench.vs_trl`: merge the results of one or more calls, derive the figures issue 16 asks
for (medians and spread of the repeats, time to first step, the trainer's model FLOP utilization, the
per-step floor) and render BENCHMARKS.md's section with every target met or missed.

Model FLOPs (stated in BENCHMARKS.md): a sequence of T tokens (prompt + completion) costs, per token,
6·N + 12·L·d·T for a forward and backward pass and 2·N + 4·L·d·T for a forward pass, where N counts the
parameters that multiply activations (every linear layer of the L blocks plus the LM head; the embedding
lookup is free) and d is the hidden size (PaLM's accounting, causal masking not discounted). The trainer
runs one forward + backward of every sequence and, where it runs one (the `proximal_forward` metric:
several updates per batch), an extra no-grad forward for the proximal log-probs: MFU = those FLOPs /
(actor train seconds × 989 TFLOP/s, H200 bf16 dense). The per-step floor is generation at plain vLLM
speed (`vllm-alone`, no log-probs) plus the forward + backward at 50% MFU.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12  # H200 SXM bf16 dense
FLOOR_MFU = 0.5
MARK_BEGIN, MARK_END = "<!-- vs_trl:begin -->", "<!-- vs_trl:end -->"
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
TARGET_RATIO = {"0.5b": 2.0, "1.5b": 1.6}
TARGET_SPREAD, TARGET_UTIL, TARGET_TTFS_GAP = 0.10, 85.0, 30.0
LEVER_LABEL = {"lp": "vLLM's per-token log-probs and default CUDA-graph sizes (`generation.behaviour_logprobs:"
                     " engine`; the configuration of 2026-12-01)",
               "stale2": "a batch up to two versions old (`flow.max_staleness: 2`)",
               "chunked": "chunked log-probs (`algo.logprob_chunk_tokens: 1024`)",
               "mps": "CUDA MPS: the services' kernels side by side on the GPU (`run.cuda_mps`)",
               "rep2": "two vLLM engine processes on the GPU, half the sequences each (`generation.replicas: 2`)",
               "compiled": "the trainer's and the reference's layers and log-prob steps torch.compiled"
                           " (`algo.compile: true`)",
               "nopc": "no prefix caching in vLLM (`generation.vllm.prefix_caching: false`)",
               "eager": "no torch.compile of the trainer's and the reference's layers and log-prob steps"
                        " (`algo.compile: false`; the configuration before 2026-12-03)"}
# Levers that run at one other shape only (every other lever is a change to the 0.5B configuration).
LEVER_SHAPE = {"eager": "1.5b"}
EXTRA_LABEL = {"trl-0.5b": "TRL GRPOTrainer (`model.generate`)", "fleet-0.5b-ppo": "rlfleet PPO + critic",
               "fleet-0.5b-hf": "rlfleet GRPO, transformers engine",
               "fleet-0.5b-inproc": "rlfleet GRPO, vLLM in the actor's process"}


# -- arithmetic -----------------------------------------------------------------------------------
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
        s["gpu_util"] = _median([p.get("gpu_util") for p in reps])
        s["first_step_s"] = _median([p.get("first_step_s") for p in reps])
        s["engine_start_s"] = _median([p.get("engine_start_s") for p in reps])
        s["stages"] = {k: _median([p.get("stages", {}).get(k) for p in reps]) for k in STAGES}
        train_s = _median([p.get("train_s") for p in reps])
        off = statistics.fmean(p.get("proximal", p.get("off_policy", 0.0)) for p in reps)
        if train_s:
            s["mfu"] = train_flops(shape, seqs, seq_len, off) / (train_s * PEAK_FLOPS)
        s["generate_tokens_per_s"] = _median([p.get("generate_tokens_per_s") for p in reps])
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


def _alone_line(s: dict[str, Any], solo: dict[str, Any]) -> str:
    """The trainer and the reference scorer with the GPU to themselves, against their stages inside the
    fleet, and the three stages alone end to end against the fleet's step: what sharing costs or saves."""
    a = s.get("alone")
    if not a:
        return f"- Trainer and reference alone: not measured ({_why(solo)})."
    st = s.get("stages", {})
    inside = (f"; inside the fleet {_f(st.get('actor_train'), 2)} s and {_f(st.get('reference'), 2)} s"
              if st.get("actor_train") else "")
    line = (f"- Trainer and reference alone (one step's batch, the GPU their own): train {a['train_s']:.2f} s "
            f"(MFU {a['mfu'] * 100:.1f}%), reference {a['reference_s']:.2f} s{inside}")
    if a.get("serial_step_s") and s.get("step_s"):
        line += (f". Generation at vLLM-alone speed, reference and training one after the other: "
                 f"{a['serial_step_s']:.2f} s a step; rlfleet's step {s['step_s']:.2f} s "
                 f"({s['step_s'] / a['serial_step_s']:.0%} of it)")
    return line + "."


def _topology(t: dict[str, Any] | None) -> str:
    if not t:
        return ""
    nodes = ", ".join(f"{k} {v}" for k, v in t.get("numa_nodes", {}).items())
    local = ", ".join(str(v) for v in t.get("gpu_local_cpus", {}).values())
    return (f"; {t.get('cpus_allowed')} CPUs allowed, NUMA {nodes or '—'}"
            + (f", the GPU's local CPUs {local}" if local else ""))


def _median(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None


# -- rendering ------------------------------------------------------------------------------------
def _f(x: Any, nd: int = 1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def _why(p: dict[str, Any]) -> str:
    """Why a phase has no figures, in the words of what stopped it."""
    if not p:
        return "not run"
    if p.get("skipped"):
        return str(p["skipped"])
    if p.get("rc") == 124:
        return f"cut off by the call's deadline after {p.get('seconds', 0):.0f} s"
    if p.get("rc") not in (None, 0):
        # The launcher's (or peer's) own last line names the cause: "controller exited ... ModuleNotFoundError".
        last = next((ln.strip() for ln in reversed(str(p.get("log_tail", "")).splitlines()) if ln.strip()), "")
        return f"exit {p['rc']}: {last.split(' (log: ')[0][:200]}" if last else f"exit {p['rc']}"
    return str(p.get("error") or f"exit {p.get('rc')}")


def _row(label: str, p: dict[str, Any], base: float | None) -> str:
    if p.get("reused_from"):
        label += f" (dry: the run of {p['reused_from']})"
    if not p.get("ok"):
        return f"| {label} | not measured: {_why(p)} | | | | | |"
    ratio = f"{p['samples_per_s'] / base:.2f}×" if base else "—"
    return (f"| {label} | {_f(p['samples_per_s'])} | {_f(p['tokens_per_s'], 0)} | {_f(p['median_step_s'], 2)} | "
            f"{_first_step(p)} | {_f(p.get('gpu_util'))} | {ratio} |")


def _first_step(p: dict[str, Any]) -> str:
    """Seconds to the first step, marked where vLLM compiled its graphs first (no cache for its config)."""
    return _f(p.get("first_step_s"), 0) + (" (compiled)" if p.get("vllm_compile") == "cold" else "")


def _host(p: dict[str, Any]) -> str:
    """The host around a phase, where the run recorded it: 1-minute load before and after, CPU clock."""
    h = p.get("host") or {}
    b, a = h.get("before") or {}, h.get("after") or {}
    if not b.get("loadavg"):
        return ""
    mhz = f", CPU {b['cpu_mhz']} → {a.get('cpu_mhz')} MHz" if b.get("cpu_mhz") else ""
    return f"; host load {b['loadavg'][0]:.1f} → {(a.get('loadavg') or [0])[0]:.1f}{mhz}"


def _peer_rows(ph: dict[str, Any], s: dict[str, Any], w: str, base: float | None) -> list[str]:
    """TRL with vLLM: one row per run, then, for several, the fastest (the one ratios are taken to)."""
    label = "TRL GRPOTrainer, vLLM colocated"
    names = [n for n in peer_names(w) if n in ph] or peer_names(w)[:1]
    if len(names) == 1:
        return [_row(label, ph.get(names[0], {}), base)]
    rows = [_row(f"{label}, run {i + 1}", ph[n], base) for i, n in enumerate(names)]
    if len(s["peers"]) > 1:
        pct = f"spread {s['peer_spread'] * 100:.0f}%"
        rows.append(f"| **TRL with vLLM, fastest of {len(s['peers'])}** ({pct}; median {_f(s['peer_median'])}) | "
                    f"**{_f(s['peer']['samples_per_s'])}** | | {_f(s['peer']['median_step_s'], 2)} | "
                    f"{_first_step(s['peer'])} | {_f(s['peer'].get('gpu_util'))} | 1.00× |")
    return rows


def first_step_gap(s: dict[str, Any]) -> tuple[float | None, str]:
    """rlfleet's time to first step minus TRL's, like with like: the repeats whose vLLM compiled from cold
    (or loaded from its cache) against TRL's runs that did the same, where the run says so, else the
    medians; where both states were measured on both sides, the larger of the two gaps."""
    peers, reps = [p for p in s.get("peers") or [s["peer"]] if p.get("first_step_s")], s["repeats"]
    if not peers or not reps:
        return None, ""
    how = {"cold": "vLLM compiling", "cached": "vLLM's compile cache warm"}
    pairs = []
    for state in how:
        mine = [p for p in reps if p.get("vllm_compile") == state]
        theirs = [p for p in peers if p.get("vllm_compile") == state]
        if mine and theirs:
            pairs.append((state, mine, theirs))
    if not pairs:  # a run that did not record compile states: the medians
        pairs = [("", reps, peers)]
    gaps = []
    for state, mine, theirs in pairs:
        a, b = _median([p.get("first_step_s") for p in mine]), _median([p.get("first_step_s") for p in theirs])
        if a is None or b is None:
            continue
        engine = _median([p.get("engine_start_s") for p in mine])
        n = "the repeat" if len(mine) == 1 else f"median of the {len(mine)} repeats"
        m = "its run" if len(theirs) == 1 else f"median of its {len(theirs)} runs"
        said = f" with {how[state]}" if state else ""
        gaps.append((a - b,
                     f"rlfleet {a:.0f} s ({n}{said}; its vLLM engine process {_f(engine, 0)} s of it), "
                     f"TRL {b:.0f} s ({m}{said})"))
    if not gaps:
        return None, ""
    gap = max(gaps)[0]
    why = "; ".join(w for _, w in gaps)
    if len(reps) > 1:
        why += "; every repeat: " + ", ".join(_first_step(p) for p in reps)
    if len(peers) > 1:
        why += "; every TRL run: " + ", ".join(_first_step(p) for p in peers)
    return gap, why


def _startup(reps: list[dict[str, Any]]) -> str:
    """One repeat's start-up timeline: each service from its first log record to ready, the engine's start."""
    tl = next((p["startup"] for p in reps if p.get("startup")), None)
    if not tl:
        return ""
    parts = []
    for name, row in sorted(tl.items(), key=lambda kv: kv[1].get("ready_s", kv[1]["first_log_s"])):
        part = f"{name} {row['first_log_s']:.0f} → {_f(row.get('ready_s'), 0)}"
        if row.get("services_started_s"):
            part += f" (services started at {row['services_started_s']:.0f})"
        if row.get("engine_s"):
            part += f" (engine process {row['engine_s']:.0f} s)"
        if row.get("trainer_s"):
            part += f" (trainer built and compiled beside it {row['trainer_s']:.0f} s)"
        if row.get("last_rpc_retry_s"):
            part += f" (an RPC to a peer failed until {row['last_rpc_retry_s']:.0f})"
        parts.append(part)
    return ", ".join(parts)


def _step_compiles(reps: list[dict[str, Any]]) -> str:
    """The repeats' steps that compiled after the warm-up (graphs, the trainer's seconds, the first guard
    that failed): a warm-up gap, to be closed, not the trainer's speed."""
    out = []
    for i, p in enumerate(reps, 1):
        steps = p.get("compiled_in_steps") or {}
        if not steps:
            continue
        recs = [r for r in p.get("step_compiles") or [] if r.get("role") == "actor"]
        part = f"r{i} step " + ", ".join(f"{k} ({v} graph{'s' if int(v) > 1 else ''})" for k, v in steps.items())
        if recs and isinstance(recs[0].get("seconds"), int | float):
            part += f" in a {recs[0]['seconds']:.1f} s train step"
        why = next((r["guard_failures"][0] for r in recs if r.get("guard_failures")), None)
        if why:
            part += f" (first failed guard: `{why}`)"
        out.append(part)
    return "; ".join(out)


def _fleet_setup(ph: dict[str, Any]) -> str:
    """The options of the fleet repeats that decide their speed, read from the config a repeat ran."""
    cfg = next((p["config"] for k, p in ph.items() if k.startswith("fleet-") and k.rsplit("-", 1)[1] in REPEATS
                and p.get("config")), None)
    if not cfg:
        return ""
    g, flow = cfg.get("generation", {}), cfg.get("flow", {})
    v = g.get("vllm") or {}
    parts = [f"`generation.engine: {g.get('engine')}` in its own process" if g.get("process")
             else f"`generation.engine: {g.get('engine')}`",
             f"`generation.behaviour_logprobs: {g.get('behaviour_logprobs', 'engine')}`",
             f"`flow.max_staleness: {flow.get('max_staleness')}`"]
    if v.get("cudagraph_max_batch"):
        parts.append(f"`generation.vllm.cudagraph_max_batch: {v['cudagraph_max_batch']}`")
    return ", ".join(parts)


def _holding(s: dict[str, Any]) -> str:
    st = {k: v for k, v in (s.get("stages") or {}).items() if v}
    if not st:
        return "no stage timings"
    k = max(st, key=lambda x: st[x])
    return f"the largest stage is {k} at {st[k]:.2f} s of the {s['step_s']:.2f} s step"


def targets(res: dict[str, Any]) -> list[str]:
    out = []

    def line(what: str, value: float | None, goal: float, fmt: str, higher: bool, why: str = "",
             how: str = "") -> None:
        """`why` is said when the target is missed, `how` (what was compared) either way."""
        if value is None:
            out.append(f"- {what}: not measured")
            return
        met = value >= goal if higher else value <= goal
        said = [x for x in (how, "" if met else why) if x]
        out.append(f"- {what}: {fmt.format(value)} (target {fmt.format(goal)}): **{'met' if met else 'missed'}**"
                   + "".join(f"; {x}" for x in said))

    for w, goal in TARGET_RATIO.items():
        s = workload_summary(res, w)
        peer = s["peer"]
        why = ""
        if s.get("ratio") is not None:
            need = res["workload"]["prompts_per_step"] * res["workload"]["group"] / (goal * peer["samples_per_s"])
            why = (f"the step must drop from {s['step_s']:.2f} s to {need:.2f} s ({s['step_s'] - need:.2f} s); "
                   + _holding(s))
        how = ""
        if len(s["peers"]) > 1 and s.get("ratio") is not None:
            how = (f"against TRL's fastest of {len(s['peers'])} runs ({peer['samples_per_s']:.1f} samples/s;"
                   " runs " + ", ".join(f"{p['samples_per_s']:.1f}" for p in s["peers"])
                   + f"); against the median of its runs {s['ratio_median']:.2f}×")
        line(f"{w}: rlfleet GRPO over TRL with vLLM, samples/s", s.get("ratio"), goal, "{:.2f}×", True, why, how)
        reps = s["repeats"]
        line(f"{w}: spread of the {len(reps)} repeats ((max − min) / median)", s.get("spread"), TARGET_SPREAD,
             "{:.0%}", False, "samples/s " + ", ".join(f"{p['samples_per_s']:.1f}" for p in reps))
        line(f"{w}: steady GPU utilization (median of the repeats)", s.get("gpu_util"), TARGET_UTIL, "{:.1f}%", True,
             _holding(s) if s.get("step_s") else "")
        gap, why = first_step_gap(s)
        line(f"{w}: time to first step, rlfleet minus TRL with vLLM", gap, TARGET_TTFS_GAP, "{:.0f} s", False,
             how=why)
    return out


def render(res: dict[str, Any]) -> str:
    ph, W = res["phases"], res["workload"]
    seqs = W["prompts_per_step"] * W["group"]
    cmds = "\n".join(res.get("commands") or [res["command"]])
    files = ", ".join(f"`bench/results/{f}`" for f in res.get("files", []))
    lines = [MARK_BEGIN, "## rlfleet vs TRL on one GPU (issues 7, 16)\n", "```\n" + cmds + "\n```\n",
             f"GPU: {res['gpu']}; " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())
             + _topology(res.get("cpu_topology"))
             + f". Raw numbers: {files}; utilization plots `bench/results/util-*.png`."
             + (" **Dry run on a CPU: the numbers mean nothing.**" if res.get("dry") else "") + "\n",
             f"Workload: Qwen2-shaped models, random weights, bf16, vocabulary {res['shapes']['0.5b']['vocab_size']:,};"
             f" {W['prompt_tokens']}-token prompts, {W['completion_tokens']}-token completions, groups of {W['group']},"
             f" {seqs} completions per step, medians over {W['steps']} steps after {W['warmup']} warm-up steps."
             " Time to first step: from the launch of the process to the end of the first optimizer step;"
             " \"(compiled)\": vLLM found no compiled graphs for its configuration on the host and compiled them"
             " (about a minute), else it loaded them from its cache.\n"]
    setup = _fleet_setup(ph)
    if setup:
        lines.append(f"rlfleet's repeats ran with {setup}.\n")
    sums = {w: workload_summary(res, w) for w in TARGET_RATIO}
    for w, s in sums.items():
        peer = s["peer"]
        base = peer.get("samples_per_s") if peer.get("ok") else None
        sh = res["shapes"][w]
        lines += [f"### {w.upper()} shape (hidden {sh['hidden_size']}, {sh['num_hidden_layers']} layers, "
                  f"{sh['num_attention_heads']} heads, {sh['num_key_value_heads']} KV heads, intermediate "
                  f"{sh['intermediate_size']})\n",
                  "| configuration | samples/s | tokens/s | step s | first step s | GPU util % | vs TRL+vLLM |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
                  *_peer_rows(ph, s, w, base)]
        if w == "0.5b":
            lines.append(_row(EXTRA_LABEL["trl-0.5b"], ph.get("trl-0.5b", {"skipped": "phase trl-0.5b not run"}), base))
        for r in REPEATS:
            lines.append(_row(f"rlfleet GRPO, vLLM in its own process, {r}", ph.get(f"fleet-{w}-{r}", {}), base))
        if s["repeats"]:
            ratio = f"{s['ratio']:.2f}×" if s.get("ratio") else "—"
            pct = "one repeat: no spread" if s.get("spread") is None else f"spread {s['spread'] * 100:.0f}%"
            lines.append(f"| **rlfleet, median of {len(s['repeats'])}** ({pct}) | "
                         f"**{_f(s['samples_per_s'])}** | | {_f(s['step_s'], 2)} | {_f(s.get('first_step_s'), 0)} | "
                         f"{_f(s.get('gpu_util'))} | **{ratio}** |")
        fl = s.get("floor")
        lines += ["", f"- Trainer MFU: {_f((s.get('mfu') or 0) * 100 if s.get('mfu') else None)}% "
                  f"({matmul_params(sh) / 1e6:,.0f}M matmul parameters; formula below)."]
        if fl:
            reach = (f"; rlfleet's {s['step_s']:.2f} s step reaches {s['floor_fraction']:.0%} of it"
                     if s.get("floor_fraction") else "")
            lines.append(f"- Per-step floor: {fl['generate_s']:.2f} s generation at plain vLLM speed + "
                         f"{fl['train_s']:.2f} s training at 50% MFU = {fl['step_s']:.2f} s{reach}.")
        else:
            lines.append(f"- Per-step floor: not measured ({_why(ph.get(f'vllm-alone-{w}', {}))}).")
        va = ph.get(f"vllm-alone-{w}", {}).get("variants")
        if va:
            lines.append("- vLLM `LLM.generate` alone, same prompts: " + ", ".join(
                f"{k} {_f(x['tokens_per_s'], 0)} tok/s" for k, x in va.items()))
        if va and s.get("generate_tokens_per_s"):
            gen = s["generate_tokens_per_s"]
            lines.append(f"- Generation inside rlfleet (its generate stage): {_f(gen, 0)} tok/s, "
                         + ", ".join(f"{gen / x['tokens_per_s']:.0%} of"
                                     f" vLLM alone {k}" for k, x in va.items()) + ".")
        lines.append(_alone_line(s, ph.get(f"train-alone-{w}", {})))
        start = _startup(s["repeats"])
        if start:
            lines.append(f"- Start-up of the first repeat (seconds from launch; first log line → ready): {start}.")
        compiled = _step_compiles(s["repeats"])
        if compiled:
            lines.append(f"- Compiled during a step, after the warm-up: {compiled}.")
        for i, p in enumerate(s["peers"]):
            if p.get("stages"):
                run = f" (run {i + 1}, {p['samples_per_s']:.1f} samples/s)" if len(s["peers"]) > 1 else ""
                lines.append(f"- TRL's own per-step timers{run} (median s): " + ", ".join(
                    f"{k.split('.')[-1]} {v:.2f}" for k, v in sorted(p["stages"].items())) + _host(p))
        lines.append("")
    for w in ("0.5b", "1.5b"):
        levers = [lv for lv in LEVER_LABEL if LEVER_SHAPE.get(lv, "0.5b") == w]
        if w != "0.5b" and not any(f"fleet-{w}-{lv}" in ph for lv in levers):
            continue  # the 0.5B table always lists its levers; another shape's only once one of them ran
        lines += [f"### Levers ({w.upper()}, one run each, against the median of the three {w.upper()} repeats)\n",
                  "| lever | samples/s | vs baseline | step s | actor_train s | reference s | GPU util % | first step s"
                  " | vLLM start s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        base = sums[w].get("samples_per_s")
        for lever in levers:
            label = LEVER_LABEL[lever]
            p = ph.get(f"fleet-{w}-{lever}", {})
            if not p.get("ok"):
                lines.append(f"| {label} | not measured: {_why(p)} | | | | | | | |")
                continue
            st = p.get("stages", {})
            vs = f"{p['samples_per_s'] / base:.2f}×" if base else "—"
            lines.append(f"| {label} | {_f(p['samples_per_s'])} | {vs} | {_f(p['median_step_s'], 2)} | "
                         f"{_f(st.get('actor_train'), 2)} | {_f(st.get('reference'), 2)} | {_f(p.get('gpu_util'))} | "
                         f"{_first_step(p)} | "
                         f"{_f(p.get('engine_start_s'), 0)} |")
        lines.append("")
    extra = [k for k in EXTRA_LABEL if k != "trl-0.5b" and k in ph]
    if extra:
        lines += ["", "| other configuration (0.5B) | samples/s | tokens/s | step s | first step s | GPU util % |"
                  " vs TRL+vLLM |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        peer05 = sums["0.5b"]["peer"]
        lines += [_row(EXTRA_LABEL[k], ph[k], peer05.get("samples_per_s") if peer05.get("ok") else None) for k in extra]
    lines += ["", "Seconds per step by stage (service histograms over the steady window; stages overlap across"
              " services):",
              "", "| configuration | " + " | ".join(STAGES) + " |", "| --- |" + " ---: |" * len(STAGES)]
    for name, p in ph.items():
        if name.startswith("fleet-") and p.get("ok"):
            st = p.get("stages", {})
            lines.append(f"| {name} | " + " | ".join(_f(st.get(k), 2) for k in STAGES) + " |")
    lines += ["", "MFU counts, per token of a T-token sequence, 6·N + 12·L·d·T FLOPs for the forward and backward"
              " pass and 2·N + 4·L·d·T for a separate proximal forward where the trainer ran one"
              " (N: parameters of the linear layers and the LM head, L layers, hidden size d), over the actor's"
              " train seconds at 989 TFLOP/s (H200 bf16 dense). Floor: completion tokens / plain vLLM tokens/s"
              " + the forward and backward FLOPs at 50% MFU.",
              "", "Targets (issue 16), from this run:", "", *targets(res), MARK_END]
    return "\n".join(lines) + "\n"
def plots(res: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    samples = res.get("gpu_samples") or []
    made = []
    for key, p in res["phases"].items():
        if "t0" not in p or p.get("reused_from"):  # a dry run's reused phase has its source's plot
            continue
        pts = [(t - p["t0"], u) for t, u, _ in samples if p["t0"] <= t <= p["t1"]]
        fig, ax = plt.subplots(figsize=(7, 2.6), dpi=80)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8)
        if p.get("window"):
            ax.axvspan(p["window"][0] - p["t0"], p["window"][1] - p["t0"], alpha=0.15, color="green",
                       label=f"steady: mean {_f(p.get('gpu_util'))}%")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_xlabel("seconds since phase start")
        ax.set_ylabel("GPU util %")
        ax.set_title(f"{key} ({res['gpu']})", fontsize=9)
        fig.tight_layout()
        path = out / f"util-{key}.png"
        fig.savefig(path)
        plt.close(fig)
        made.append(path)
    return made


def report(paths: list[Path], out: Path, update_benchmarks: bool) -> None:
    res = merge(paths)
    out.mkdir(parents=True, exist_ok=True)
    md = render(res)
    (out / "vs_trl.md").write_text(md)
    made = plots(res, out)
    names = ", ".join(p.name for p in made) or "none (no matplotlib)"
    print(f"report: {out / 'vs_trl.md'}; plots: {names}", flush=True)
    if update_benchmarks:
        bm = REPO / "BENCHMARKS.md"
        text = bm.read_text()
        if MARK_BEGIN in text and MARK_END in text:
            text = text[: text.index(MARK_BEGIN)] + md + text[text.index(MARK_END) + len(MARK_END) + 1:]
        else:
            text = text.rstrip("\n") + "\n\n" + md
        bm.write_text(text)
    print(md)
