"""BENCHMARKS.md's section of `bench.vs_trl`, rendered from a merged result: per shape the peer, the
repeats and the figures around them, the levers, the stages, then the targets."""

from __future__ import annotations

from typing import Any

from bench.vs_trl.cells import first_step_cell, num, why_not
from bench.vs_trl.figures import REPEATS, STAGES, matmul_params, peer_names, workload_summary
from bench.vs_trl.targets import TARGET_RATIO, targets

MARK_BEGIN, MARK_END = "<!-- vs_trl:begin -->", "<!-- vs_trl:end -->"


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


def _alone_line(s: dict[str, Any], solo: dict[str, Any]) -> str:
    """The trainer and the reference scorer with the GPU to themselves, against their stages inside the
    fleet, and the three stages alone end to end against the fleet's step: what sharing costs or saves."""
    a = s.get("alone")
    if not a:
        return f"- Trainer and reference alone: not measured ({why_not(solo)})."
    st = s.get("stages", {})
    inside = (f"; inside the fleet {num(st.get('actor_train'), 2)} s and {num(st.get('reference'), 2)} s"
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


def _row(label: str, p: dict[str, Any], base: float | None) -> str:
    if p.get("reused_from"):
        label += f" (dry: the run of {p['reused_from']})"
    if not p.get("ok"):
        return f"| {label} | not measured: {why_not(p)} | | | | | |"
    ratio = f"{p['samples_per_s'] / base:.2f}×" if base else "—"
    return (f"| {label} | {num(p['samples_per_s'])} | {num(p['tokens_per_s'], 0)} | {num(p['median_step_s'], 2)} | "
            f"{first_step_cell(p)} | {num(p.get('gpu_util'))} | {ratio} |")


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
        rows.append(f"| **TRL with vLLM, fastest of {len(s['peers'])}** ({pct}; median {num(s['peer_median'])}) | "
                    f"**{num(s['peer']['samples_per_s'])}** | | {num(s['peer']['median_step_s'], 2)} | "
                    f"{first_step_cell(s['peer'])} | {num(s['peer'].get('gpu_util'))} | 1.00× |")
    return rows


def _startup(reps: list[dict[str, Any]]) -> str:
    """One repeat's start-up timeline: each service from its first log record to ready, the engine's start."""
    tl = next((p["startup"] for p in reps if p.get("startup")), None)
    if not tl:
        return ""
    parts = []
    for name, row in sorted(tl.items(), key=lambda kv: kv[1].get("ready_s", kv[1]["first_log_s"])):
        part = f"{name} {row['first_log_s']:.0f} → {num(row.get('ready_s'), 0)}"
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
                         f"**{num(s['samples_per_s'])}** | | {num(s['step_s'], 2)} | {num(s.get('first_step_s'), 0)} | "
                         f"{num(s.get('gpu_util'))} | **{ratio}** |")
        fl = s.get("floor")
        lines += ["", f"- Trainer MFU: {num((s.get('mfu') or 0) * 100 if s.get('mfu') else None)}% "
                  f"({matmul_params(sh) / 1e6:,.0f}M matmul parameters; formula below)."]
        if fl:
            reach = (f"; rlfleet's {s['step_s']:.2f} s step reaches {s['floor_fraction']:.0%} of it"
                     if s.get("floor_fraction") else "")
            lines.append(f"- Per-step floor: {fl['generate_s']:.2f} s generation at plain vLLM speed + "
                         f"{fl['train_s']:.2f} s training at 50% MFU = {fl['step_s']:.2f} s{reach}.")
        else:
            lines.append(f"- Per-step floor: not measured ({why_not(ph.get(f'vllm-alone-{w}', {}))}).")
        va = ph.get(f"vllm-alone-{w}", {}).get("variants")
        if va:
            lines.append("- vLLM `LLM.generate` alone, same prompts: " + ", ".join(
                f"{k} {num(x['tokens_per_s'], 0)} tok/s" for k, x in va.items()))
        if va and s.get("generate_tokens_per_s"):
            gen = s["generate_tokens_per_s"]
            lines.append(f"- Generation inside rlfleet (its generate stage): {num(gen, 0)} tok/s, "
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
                lines.append(f"| {label} | not measured: {why_not(p)} | | | | | | | |")
                continue
            st = p.get("stages", {})
            vs = f"{p['samples_per_s'] / base:.2f}×" if base else "—"
            lines.append(f"| {label} | {num(p['samples_per_s'])} | {vs} | {num(p['median_step_s'], 2)} | "
                         f"{num(st.get('actor_train'), 2)} | {num(st.get('reference'), 2)} | "
                         f"{num(p.get('gpu_util'))} | {first_step_cell(p)} | "
                         f"{num(p.get('engine_start_s'), 0)} |")
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
            lines.append(f"| {name} | " + " | ".join(num(st.get(k), 2) for k in STAGES) + " |")
    lines += ["", "MFU counts, per token of a T-token sequence, 6·N + 12·L·d·T FLOPs for the forward and backward"
              " pass and 2·N + 4·L·d·T for a separate proximal forward where the trainer ran one"
              " (N: parameters of the linear layers and the LM head, L layers, hidden size d), over the actor's"
              " train seconds at 989 TFLOP/s (H200 bf16 dense). Floor: completion tokens / plain vLLM tokens/s"
              " + the forward and backward FLOPs at 50% MFU.",
              "", "Targets (issue 16), from this run:", "", *targets(res), MARK_END]
    return "\n".join(lines) + "\n"
