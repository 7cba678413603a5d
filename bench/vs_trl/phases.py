"""The phases of a run: what each measures (`Phase`), the levers (one change each to rlfleet's
configuration), the groups one device call holds, and their time estimates (`plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.vs_trl.workload import say


@dataclass(frozen=True)
class Phase:
    name: str
    kind: str  # trl | trl-vllm | fleet | vllm-alone | train-alone
    workload: str
    group: str
    est_s: float  # expected seconds on one H200 (from the runs of issues 7 and 16), start-up included
    engine: str = "vllm"
    algo: str = "grpo"
    process: bool = True
    algo_opts: dict[str, Any] = field(default_factory=dict)
    vllm_opts: dict[str, Any] = field(default_factory=dict)
    gen_opts: dict[str, Any] = field(default_factory=dict)
    flow_opts: dict[str, Any] = field(default_factory=dict)
    run_opts: dict[str, Any] = field(default_factory=dict)
    lever: str = ""  # the lever a `fleet-<w>-<lever>` phase adds (empty: the baseline)


# A lever's (algo options, vllm options, generation options, flow options, run options) on top of rlfleet's
# configuration for this workload (`config.FLEET_GENERATION`, `FLEET_VLLM`, `FLEET_SHAPE`).
LeverOptions = tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]
LEVERS: dict[str, LeverOptions] = {
    # The configuration of the 2026-12-01 run: vLLM returns each sampled token's log-prob (decoupled PPO's
    # behaviour policy), every CUDA-graph size vLLM captures by default.
    "lp": ({}, {"cudagraph_max_batch": None}, {"behaviour_logprobs": "engine"}, {}, {}),
    # At 0.5B the chain generate -> reference -> train -> sync paces the step at staleness 1 (2026-12-02:
    # 71% utilization); a batch may then be two versions old, so generation runs one more step ahead.
    "stale2": ({}, {}, {}, {"max_staleness": 2}, {}),
    "chunked": ({"logprob_chunk_tokens": 1024}, {}, {}, {}, {}),
    # The 0.5B configuration's eager trainer and reference taken back: both compiled.
    "compiled": ({"compile": True}, {}, {}, {}, {}),
    # At 0.5B one Python thread, vLLM's scheduler, paces decoding (py-spy on 2026-12-03 21:38: the
    # engine's main thread busy all the time, the GPU 20-28% busy while generation runs alone). Two
    # engine processes on the GPU take half the sequences each, on two cores (generation 2.11 -> 1.33 s
    # on 2026-12-03 22:08, compiled; eagerly on 2026-12-04 the trainer then slowed by more than that).
    "rep2": ({}, {}, {"replicas": 2}, {}, {}),
    # At 0.5B generation runs at 60-65% of its speed alone while the GPU idles 40% (2026-12-03): the
    # processes' kernels time-slice. Under CUDA MPS they run side by side: 0.75x on 2026-12-03 11:11
    # (the trainer sped up, the generation that paces the step slowed).
    "mps": ({}, {}, {}, {}, {"cuda_mps": True}),
    # The same thread's per-token prefix-cache work (block hashes, caching) left out.
    "nopc": ({}, {"prefix_caching": False}, {}, {}, {}),
}
# At 1.5B the trainer is the step (actor_train 4.0 of 4.2 s eagerly on 2026-12-02 16:42): compile is its lever.
EAGER: LeverOptions = ({"compile": False}, {}, {}, {}, {})


def phases() -> list[Phase]:
    out: list[Phase] = []
    # Seconds each phase took on the H200 runs of 2026-12-02 (13:09 and 16:42, bench/results/), launch to
    # exit, plus ~10%: a fleet repeat 72-107 s at 0.5B and 70-157 s at 1.5B (the first launch of a shape
    # compiles vLLM: 80 s and 130 s since the engine starts early), vLLM alone 49-60 s (it loads the
    # repeats' graphs), TRL with vLLM 71-98 s at 0.5B, 157 s at 1.5B when it compiles and 80 s when it
    # loads, TRL with `generate` 67-81 s, a lever ~93 s when it loads the repeats' graphs (`lp` changes
    # the CUDA-graph sizes and compiles; `compile` adds torch.compile). A fleet phase ends once its last
    # measured step is in.
    # Groups hold at most ~9.5 min, one device call each, in the order one 30-minute session runs them:
    # the 1.5B repeats and the 0.5B repeats, each with vLLM, the trainer and the reference alone after
    # them (vLLM loads the graphs they compiled), then TRL with vLLM, whose runs vary by a third (38.8 to
    # 54.2 samples/s at 0.5B at 16:42): a first run of each shape and a second at 0.5B, then `peers2` with
    # the rest of its repeats and TRL with `generate` (the second peer row). `mps`, measured at 0.75x
    # on 2026-12-03 11:11, left `peers2` for `levers`, so that the four calls leave a session slack for
    # a machine that is taken back; `compiled` (the 0.5B configuration's eager trainer taken back), `rep2`
    # (two engine processes) and `stale2` (+11% eager on 2026-12-03 04:18) make `levers2`.
    est = {"fleet-1.5b-r1": 170, "fleet-1.5b": 115, "vllm-alone-1.5b": 65, "train-alone-1.5b": 60,
           "fleet-0.5b-r1": 120, "fleet-0.5b": 100, "vllm-alone-0.5b": 55, "train-alone-0.5b": 45,
           "trl-vllm-1.5b": 170, "trl-vllm-1.5b-warm": 100, "trl-vllm-0.5b": 105, "trl-vllm-0.5b-warm": 90,
           "trl-0.5b": 90, "lever": 100}
    for w in ("1.5b", "0.5b"):
        out += [Phase(f"fleet-{w}-r{i}", "fleet", w, w, est.get(f"fleet-{w}-r{i}", est[f"fleet-{w}"]))
                for i in (1, 2, 3)]
        out.append(Phase(f"vllm-alone-{w}", "vllm-alone", w, w, est[f"vllm-alone-{w}"]))
        out.append(Phase(f"train-alone-{w}", "train-alone", w, w, est[f"train-alone-{w}"]))
    # TRL's runs in the order they matter: the first of each shape and a second at 0.5B, then the rest.
    # Its first run of a shape compiles vLLM's graphs into TRL's own cache, the later ones load them.
    for group, names in (("peers", ("trl-vllm-1.5b", "trl-vllm-0.5b", "trl-vllm-0.5b-r2")),
                         ("peers2", ("trl-vllm-0.5b-r3", "trl-vllm-1.5b-r2", "trl-vllm-1.5b-r3"))):
        for name in names:
            w = name.split("-")[2]
            out.append(Phase(name, "trl-vllm", w, group, est[f"trl-vllm-{w}" + ("-warm" if "-r" in name else "")]))
    out.append(Phase("trl-0.5b", "trl", "0.5b", "peers2", est["trl-0.5b"]))
    lever_group = {"compiled": "levers2", "rep2": "levers2", "stale2": "levers2"}
    last = ("mps",)
    for lever in sorted(LEVERS, key=lambda n: list(lever_group).index(n) if n in lever_group
                        else len(lever_group) + (n in last)):
        algo_opts, vllm_opts, gen_opts, flow_opts, run_opts = LEVERS[lever]
        out.append(Phase(f"fleet-0.5b-{lever}", "fleet", "0.5b", lever_group.get(lever, "levers"),
                         est["lever"] + {"lp": 45, "compiled": 30, "rep2": 20}.get(lever, 0), algo_opts=algo_opts,
                         vllm_opts=vllm_opts, gen_opts=gen_opts, flow_opts=flow_opts, run_opts=run_opts, lever=lever))
    algo_opts, vllm_opts, gen_opts, flow_opts, _ = EAGER
    out.append(Phase("fleet-1.5b-eager", "fleet", "1.5b", "levers15", est["fleet-1.5b"], algo_opts=algo_opts,
                     vllm_opts=vllm_opts, gen_opts=gen_opts, flow_opts=flow_opts, lever="eager"))
    out += [Phase("fleet-0.5b-ppo", "fleet", "0.5b", "extra", 200, algo="ppo"),
            Phase("fleet-0.5b-hf", "fleet", "0.5b", "extra", 250, engine="transformers", process=False),
            Phase("fleet-0.5b-inproc", "fleet", "0.5b", "extra", 180, process=False)]
    return out


DEFAULT_GROUPS = ("1.5b", "0.5b", "peers", "peers2", "levers2", "levers")


def select(spec: str | None) -> list[Phase]:
    """Phases named by `spec` (comma-separated phase or group names; `all`; default: the default groups)."""
    every = phases()
    names = [s for s in (spec or ",".join(DEFAULT_GROUPS)).split(",") if s]
    known = {p.name for p in every} | {p.group for p in every} | {"all"}
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown phase or group {', '.join(bad)}; known: {', '.join(sorted(known))}")
    return [p for p in every if "all" in names or p.name in names or p.group in names]


def print_plan(chosen: list[Phase], deadline_s: float) -> None:
    total = 0.0
    for g in dict.fromkeys(p.group for p in chosen):
        ps = [p for p in chosen if p.group == g]
        s = sum(p.est_s for p in ps)
        total += s
        say(f"group {g}: ~{s / 60:.1f} min (" + ", ".join(f"{p.name} ~{p.est_s:.0f} s" for p in ps) + ")")
    say(f"estimated total ~{total / 60:.1f} min for {len(chosen)} phases; deadline {deadline_s:.0f} s")
