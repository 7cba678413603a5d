"""rlfleet against TRL on one GPU, same model, data and hyper-parameters, in one run (issues 7, 16).

    python -m bench.vs_trl plan                                   # the phases, their groups and time estimates
    python -m bench.vs_trl run --phases peers --out DIR           # on a GPU host: one group per device call
    python -m bench.vs_trl report --results A.json B.json ...     # merge calls, render BENCHMARKS.md and plots
    BENCH_DRY=1 python -m bench.vs_trl run --out DIR              # CPU dry run of every phase (measures nothing)

Workloads: Qwen2-shaped models with random weights in bf16, the 0.5B shape (hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864) and the 1.5B shape (hidden 1536, 28 layers, 12 heads, 2 KV heads,
intermediate 8960), vocabulary 151,936; prompts of exactly 64 tokens (`services.tasks.synthetic`),
completions of exactly 256 tokens, GRPO with groups of 8 and 256 completions per step, KL 0.04 (k3, in
the loss), lr 1e-6, one epoch, one optimizer step per step, micro-batches of 16 sequences.

Phases (each its own process, so each starts with the GPU to itself), grouped so that one group fits one
device call of at most 10 minutes (`plan` prints the estimates, seconds measured on the H200 run of
2026-12-02), in the order one 30-minute device session runs them: `1.5b` (the three 1.5B fleet
repeats, vLLM alone, trainer and reference alone), `0.5b` (the same at 0.5B), `peers` (TRL with vLLM,
both workloads, and a second run at 0.5B), `peers2` (TRL with vLLM's other repeats, TRL with
generate); `levers2` (`compiled`, `rep2`, then `stale2`) and `levers` (`lp`, the 0.5B fleet with vLLM's
log-prob output, `chunked`, then `mps`) get what is left. A run first checks, in seconds, that every service and both
peers import on the host, and skips a phase that would not finish before `--deadline-s`.

- `trl-vllm-<w>`, `-r2`, `-r3`: TRL 1.16 `GRPOTrainer` with vLLM colocated (`bench.trl_peer --use-vllm`): the
  peer, repeated like rlfleet (ratios are taken to its fastest run; `vs_trl_report`).
- `fleet-<w>-r1..r3`: `rlfleet up`, every service on the GPU, `engine: vllm` in its own process, three
  times: median and spread. rlfleet's configuration for this workload (`FLEET_GENERATION`, `FLEET_VLLM`,
  `FLEET_SHAPE`): the trainer's proximal log-probs score every batch (`generation.behaviour_logprobs:
  trainer`, no per-token log-probs from vLLM) and vLLM captures CUDA graphs up to the 256 sequences of a
  step; at 0.5B the trainer and the reference run eagerly (`algo.compile: false`), at 1.5B compiled. A
  phase is stopped as soon as its last measured step is in: no final checkpoint or export.
- `vllm-alone-<w>`: the engine the fleet's actor starts (same options, environment and sampler), driven by
  vLLM's own `LLM.generate` on one step's prompts, plain and with per-token log-probs: the generation
  floor. It runs after the fleet repeats of its shape, so it loads their compiled graphs.
- `train-alone-<w>`: the repeats' trainer and reference scorer (built as the actor and the reference
  service build them) on one step's batch, the GPU their own: their own speed, apart from the cost of
  sharing the GPU with generation.
- `trl-0.5b`: TRL with `model.generate` (the second peer row).
- `fleet-0.5b-<lever>`: one change to `fleet-0.5b`: `lp` (vLLM's per-token log-probs and its default
  CUDA-graph sizes: the configuration of the 2026-12-01 run), `compiled` (algo.compile true: the trainer
  and the reference compiled), `rep2` (generation.replicas 2: two engine processes on the GPU), `nopc`
  (generation.vllm.prefix_caching false), `stale2` (flow.max_staleness 2), `chunked`
  (algo.logprob_chunk_tokens), `mps` (run.cuda_mps: the services as clients of a CUDA MPS daemon); at
  1.5B `eager` (algo.compile false: no torch.compile). Fused AdamW, a
  lever until the 13:08 run of 2026-12-02 (+6%), is rlfleet's default since, as it is transformers' (TRL's
  optimizer); torch.compile, a lever until 2026-12-03 (1.30-1.41x at 1.5B, 1.04-1.09x at 0.5B), too.
- `extra` (not default): PPO with a critic, the transformers engine, the engine inside the actor.

Steady state drops the first `--warmup` steps and takes medians over the rest. Time to first step runs
from the phase's process launch to the end of the first optimizer step. GPU utilization is sampled with
NVML every 100 ms and averaged over each phase's steady window. The fleet's seconds per stage are
differences of the services' `rlfleet_stage_latency_seconds` sums over the steady window per step.
A dry run (BENCH_DRY=1) shrinks both shapes to one tiny model, runs TRL once on the CPU for both TRL
kinds, and starts ONE fleet for every fleet phase (`fleet_config(dry=True)`: PPO with every service,
the transformers engine in its own process, the levers a CPU can run); each fleet phase still builds
and validates the config the GPU run will start. It proves the harness, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench import common
from bench.common import read_rows

REPO = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/rlfleet-vs-trl"))
DRY = os.environ.get("BENCH_DRY") == "1"

_COMMON: dict[str, Any] = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                               tie_word_embeddings=True)
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, **_COMMON),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, **_COMMON),
}
W: dict[str, Any] = dict(prompts_per_step=32, group=8, prompt_tokens=64, completion_tokens=256, micro_batch=16,
                         kl_coef=0.04, lr=1e-6, steps=5, warmup=2)
if DRY:
    for shape in SHAPES.values():
        shape.update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, vocab_size=260)
    W.update(prompts_per_step=2, group=2, prompt_tokens=4, completion_tokens=4, micro_batch=2, steps=2, warmup=1)
N_SPECIAL = 4  # <pad> <s> </s> <unk> of the word-level tokenizer
PORTS = {"controller": 0, "actor": 1, "critic": 2, "reward": 3, "reference": 4}

say = partial(common.say, tag="vs_trl")


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


# rlfleet's configuration for this workload (every fleet phase but a lever's own change): the trainer's
# proximal log-probs score every batch instead of vLLM's per-token log-prob output, which cost ~40% of its
# decode throughput on 2026-12-01 (generation.behaviour_logprobs); CUDA graphs only up to the sequences
# of one step (vLLM's default captures up to 512, twice the batch this workload ever decodes); a fixed
# KV cache, so that vLLM skips its memory profiling and the actor builds and compiles its trainer while
# the engine starts (a step's 256 sequences at max_model_len 512 need 1.5 GiB at 0.5B, 3.5 GiB at 1.5B).
FLEET_GENERATION: dict[str, Any] = {"behaviour_logprobs": "trainer"}
FLEET_VLLM: dict[str, Any] = {"cudagraph_max_batch": W["prompts_per_step"] * W["group"], "kv_cache_gib": 8}
# Per shape, on top of that: at 0.5B the trainer and the reference run eagerly. torch.compile gained
# 4-9% there (2026-12-03 04:03), but its cold compile, ~60 s beside the engine's start, set the time to
# first step from a cold host (85 s against TRL's 52 s at 16:32); eagerly the trainer's longer step
# also paces the one engine evenly (2026-12-04 01:31: spread 6%, utilization 92%, against 19% and 70%
# compiled at 16:32). At 1.5B the trainer is the step and compiled (1.30-1.41x): rlfleet's defaults.
FLEET_SHAPE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # workload -> (algo, generation) options
    "0.5b": ({"compile": False}, {}),
    "1.5b": ({}, {}),
}

# A lever's (algo options, vllm options, generation options, flow options, run options) on top of that
# configuration.
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
# What a CPU dry run can start: no vLLM (its options are refused by the transformers engine) and no
# inductor (minutes per graph on two cores; tests/unit/test_trainer_levers.py checks compile).
DRY_LEVERS = {"logprob_chunk_tokens": 2}


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


# -- GPU utilization ---------------------------------------------------------------------------------
class GpuSampler(threading.Thread):
    """NVML utilization and memory of GPU 0 every `period` seconds; silent (no samples) without NVML."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period, self.stop = period, threading.Event()
        self.samples: list[tuple[float, float, float]] = []
        self.idle_gib: float | None = None  # see mark_idle
        self.name = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            raw = pynvml.nvmlDeviceGetName(self.h)
            self.name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception:
            self.nvml = None

    def run(self) -> None:
        while self.nvml is not None and not self.stop.is_set():
            try:
                u = self.nvml.nvmlDeviceGetUtilizationRates(self.h)
                m = self.nvml.nvmlDeviceGetMemoryInfo(self.h)
                self.samples.append((time.time(), float(u.gpu), m.used / 2**30))
            except Exception:
                pass
            time.sleep(self.period)

    def mark_idle(self) -> None:
        """Take the GPU memory in use now (no phase running) as the level `wait_released` waits for."""
        if self.nvml is not None:
            self.idle_gib = self.nvml.nvmlDeviceGetMemoryInfo(self.h).used / 2**30

    def wait_released(self, timeout_s: float = 30.0, slack_gib: float = 2.0) -> float:
        """Wait until the GPU's memory is back near its idle level (a killed phase's processes free
        theirs a moment after they exit): the next phase's vLLM sizes its cache from what is free.
        Returns the seconds waited (0 without NVML)."""
        idle = self.idle_gib
        if self.nvml is None or idle is None:
            return 0.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.nvml.nvmlDeviceGetMemoryInfo(self.h).used / 2**30 <= idle + slack_gib:
                break
            time.sleep(0.2)
        return time.monotonic() - t0

    def between(self, t0: float, t1: float) -> list[tuple[float, float, float]]:
        return [s for s in self.samples if t0 <= s[0] <= t1]


def mean_util(samples: list[tuple[float, float, float]]) -> float | None:
    return statistics.fmean(s[1] for s in samples) if samples else None


def run_proc(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    say("$", " ".join(cmd), f"(cap {timeout_s:.0f} s, log {log})")
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env or os.environ.copy(),
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return 124


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _trl_stages(steps: list[dict[str, Any]]) -> dict[str, float]:
    """TRL's own profiling timers per step (median), mapped onto our stage names where they match."""
    per: dict[str, list[float]] = {}
    for s in steps:
        for k, v in (s.get("profile") or {}).items():
            if isinstance(v, int | float):
                per.setdefault(k, []).append(float(v))
    return {k: statistics.median(v) for k, v in per.items() if v}


def scrape_stages(cfg: dict[str, Any]) -> dict[str, float]:
    """Sum of rlfleet_stage_latency_seconds per stage over every running service."""
    import httpx

    out: dict[str, float] = {}
    for ep in cfg["services"].values():
        try:
            text = httpx.get(f"http://127.0.0.1:{ep['http_port']}/metrics", timeout=5).text
        except Exception:
            continue
        for line in text.splitlines():
            m = re.match(r'^rlfleet_stage_latency_seconds_sum\{([^}]*)\} ([-+0-9.eE]+)$', line)
            if m:
                stage = re.search(r'stage="([^"]+)"', m.group(1))
                if stage:
                    out[stage.group(1)] = out.get(stage.group(1), 0.0) + float(m.group(2))
    return out


# -- model and data ---------------------------------------------------------------------------------
def model_dir(workload: str) -> Path:
    return WORK / ("model-dry" if DRY else f"model-{workload}")  # a dry run has one tiny shape


def build_model(workload: str) -> Path:
    """Random-weight Qwen2 in bf16 plus a word tokenizer whose vocabulary is the model's (every id decodes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.models.roles.tokenizer import build_tokenizer_from_vocab

    path = model_dir(workload)
    if (path / "config.json").exists():
        return path
    shape = SHAPES[workload]
    tok = build_tokenizer_from_vocab(synthetic_task(workload).vocab(), "word")
    cfg = Qwen2Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the phases' processes want this memory, and NVML counts it as used
    return path


def synthetic_task(workload: str = "0.5b") -> Any:
    from services.tasks.synthetic import SyntheticTask

    return SyntheticTask({"prompt_tokens": W["prompt_tokens"], "completion_tokens": W["completion_tokens"],
                          "words": SHAPES[workload]["vocab_size"] - N_SPECIAL})


# -- phases -----------------------------------------------------------------------------------------
def trl_cmd(p: Phase, model: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "bench.trl_peer", "--model", str(model), "--out", str(out),
           "--steps", str(W["steps"]), "--warmup", str(W["warmup"]), "--prompts-per-step", str(W["prompts_per_step"]),
           "--group", str(W["group"]), "--prompt-tokens", str(W["prompt_tokens"]),
           "--completion-tokens", str(W["completion_tokens"]), "--micro-batch", str(W["micro_batch"]),
           "--kl-coef", str(W["kl_coef"]), "--lr", str(W["lr"])]
    if DRY:  # no vLLM on a CPU: TRL's generate stands in for its vLLM mode
        return [*cmd, "--device", "cpu", "--words", str(SHAPES[p.workload]["vocab_size"] - N_SPECIAL)]
    return cmd + (["--use-vllm"] if p.kind == "trl-vllm" else [])


def phase_trl(p: Phase, cap: float, gpu: GpuSampler) -> dict[str, Any]:
    out, log = WORK / f"{p.name}.json", WORK / f"{p.name}.log"
    out.unlink(missing_ok=True)
    t0 = time.time()
    rc = run_proc(trl_cmd(p, model_dir(p.workload), out), log, cap, env=phase_env(p))
    res: dict[str, Any] = {"rc": rc, "t0": t0, "t1": time.time(), "log_tail": tail(log)}
    if not out.exists():
        return res
    data = json.loads(out.read_text())
    res["raw"] = {k: v for k, v in data.items() if k not in ("traceback",)}
    if not data.get("ok"):
        res["error"] = data.get("error")
        return res
    steps = data["steps"][W["warmup"]:]
    st = data["steady"]
    w0, w1 = steps[0]["wall_begin"], steps[-1]["wall_end"]
    res.update(ok=True, window=(w0, w1), samples_per_s=st["samples_per_s"], tokens_per_s=st["tokens_per_s"],
               median_step_s=st["median_step_s"], steps_measured=st["steps_measured"],
               first_step_s=data["steps"][0]["wall_end"] - t0, gpu_util=mean_util(gpu.between(w0, w1)),
               stages=_trl_stages(steps))
    return res


def fleet_config(p: Phase, model: Path, port_base: int, dry: bool = DRY) -> dict[str, Any]:
    """The `rlfleet up` config of a fleet phase; `dry` gives the one CPU stand-in every fleet phase of a
    dry run shares: PPO (every service, the critic too), the transformers engine in its own process and
    the levers a CPU can run, so that one launch covers what the GPU phases start between them."""
    device = "cpu" if dry else "cuda"
    svc: dict[str, dict[str, Any]] = {n: {"grpc_port": port_base + i, "http_port": port_base + 10 + i}
                                      for n, i in PORTS.items()}
    for n in ("actor", "critic", "reference"):
        svc[n]["device"] = device
    shape_algo, shape_gen = FLEET_SHAPE[p.workload]
    algo_opts = {**shape_algo, **p.algo_opts}
    gen_opts = {**FLEET_GENERATION, **shape_gen, **p.gen_opts}
    # A lever's None takes an option of rlfleet's configuration back to vLLM's default.
    vllm_opts = {k: v for k, v in {**FLEET_VLLM, **p.vllm_opts}.items() if v is not None}
    if dry:
        p = Phase(p.name, p.kind, p.workload, p.group, p.est_s, engine="transformers", algo="ppo", process=True)
        algo_opts, vllm_opts, gen_opts = dict(DRY_LEVERS), {}, dict(FLEET_GENERATION)
    return {
        "run": {"name": p.name.replace("-", "_").replace(".", "_"), "dir": str(WORK / p.name), "seed": 0,
                "max_steps": W["warmup"] + W["steps"] + 1, **({} if dry else p.run_opts)},
        "task": {"name": "synthetic", "eval_size": 0,
                 "params": {"prompt_tokens": W["prompt_tokens"], "completion_tokens": W["completion_tokens"],
                            "words": SHAPES[p.workload]["vocab_size"] - N_SPECIAL}},
        "models": {"policy": {"path": str(model), "dtype": "float32" if dry else "bfloat16"}},
        "algo": {"name": p.algo, "group_size": W["group"], "kl_coef": W["kl_coef"], "kl_estimator": "k3",
                 "kl_in": "loss", "lr": W["lr"], "critic_lr": 1e-5, "ppo_epochs": 1,
                 "minibatch_size": W["prompts_per_step"] * W["group"], "micro_batch_size": W["micro_batch"],
                 **algo_opts},
        # A dry run has no vLLM: the transformers engine stands in, so the harness itself is exercised.
        "generation": {"engine": p.engine, "device": device, "process": p.process,
                       **gen_opts,
                       "max_new_tokens": W["completion_tokens"], "temperature": 1.0,
                       "micro_batch": 0,  # vLLM: no cap on sequences per engine step
                       **({} if p.engine != "vllm" else
                          {"vllm": {"gpu_memory_utilization": 0.2, "max_model_len": 512, **vllm_opts}})},
        "batch": {"prompts_per_step": W["prompts_per_step"], "prompts_per_message": W["prompts_per_step"]},
        "services": svc,
        # Generation of step n+1 overlaps training of step n; nothing is resent during a slow start.
        "flow": {"max_staleness": 1, "resend_after_s": 900.0, "rpc_timeout_s": 900.0, **p.flow_opts},
        "checkpoint": {"every": 1000},
    }


def _effective(cfg: dict[str, Any]) -> str:
    """A fleet's configuration without what only names it (run name/dir, ports): equal means same run."""
    c = json.loads(json.dumps(cfg))
    c["run"].pop("name")
    c["run"].pop("dir")
    c.pop("services")
    return json.dumps(c, sort_keys=True)


def phase_fleet(p: Phase, cap: float, gpu: GpuSampler, port_base: int) -> dict[str, Any]:
    cfg = fleet_config(p, model_dir(p.workload), port_base)
    run_dir = Path(cfg["run"]["dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg_path = WORK / f"{p.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = WORK / f"{p.name}.log"
    cmd = [sys.executable, "-m", "services.cli", "up", "--config", str(cfg_path), "--ready-timeout", str(int(cap))]
    say("$", " ".join(cmd), f"(cap {cap:.0f} s, log {log})")
    t0 = time.time()
    snaps: dict[int, tuple[float, dict[str, float]]] = {}
    first, last = W["warmup"], W["warmup"] + W["steps"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=phase_env(p),
                                start_new_session=True)
        deadline = time.monotonic() + cap
        stopped = False
        while proc.poll() is None and time.monotonic() < deadline:
            rows = read_rows(run_dir / "metrics.jsonl")
            done = max((int(r["step"]) for r in rows), default=0)
            for k in (first, last):
                if done >= k and k not in snaps:
                    snaps[k] = (time.time(), scrape_stages(cfg))
            if last in snaps:
                # Everything measured is in: the final checkpoint and export would only cost device time.
                stopped = stop_fleet(proc)
                break
            time.sleep(0.2)
        rc = proc.poll()
        if rc is None:
            _kill_group(proc)
            rc = 124
    released_s = gpu.wait_released() if stopped else 0.0
    res: dict[str, Any] = {"rc": 0 if stopped else rc, "t0": t0, "t1": time.time(), "log_tail": tail(log),
                           "config": cfg, "effective": _effective(cfg), "stopped_after_measuring": stopped,
                           "gpu_released_s": round(released_s, 1)}
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if "step_s" in r]
    res["rows"] = rows
    res["engine_start_s"] = engine_start_s(run_dir)
    res["startup"] = startup_timeline(run_dir, t0)
    res["step_compiles"] = step_compiles(run_dir)
    steady = [r for r in rows if first < int(r["step"]) <= last]
    if rows and int(rows[0]["step"]) == 1:
        res["first_step_s"] = float(rows[0]["time"]) - t0
    if len(steady) < max(2, W["steps"] // 2):
        res["error"] = f"only {len(steady)} steady steps recorded"
        return res
    step_s = statistics.median(float(r["step_s"]) for r in steady)
    w0 = next((float(r["time"]) for r in rows if int(r["step"]) == first),
              float(steady[0]["time"]) - float(steady[0]["step_s"]))
    w1 = float(steady[-1]["time"])
    stages: dict[str, float] = {"advantage": statistics.median(float(r.get("advantage_s", 0.0)) for r in steady)}
    if first in snaps and last in snaps:
        a, b = snaps[first][1], snaps[last][1]
        for k in b:
            stages[k] = (b[k] - a.get(k, 0.0)) / (last - first)
    tokens = statistics.median(int(r["tokens"]) for r in steady)
    gen_s = stages.get("generate")
    res.update(ok=True, window=(w0, w1), steps_measured=len(steady), median_step_s=step_s,
               samples_per_s=statistics.median(int(r["samples"]) for r in steady) / step_s,
               tokens_per_s=tokens / step_s,
               train_s=statistics.median(float(r.get("train_s", 0.0)) for r in steady),
               off_policy=statistics.fmean(float(r.get("off_policy", 0.0)) for r in steady),
               # Steps whose trainer ran the separate proximal pass (runs before 2026-12-02 08:30 did
               # on every off-policy step and logged only off_policy).
               proximal=statistics.fmean(float(r.get("proximal_forward", r.get("off_policy", 0.0)))
                                         for r in steady),
               response_len=statistics.median(float(r.get("response_len_mean", W["completion_tokens"]))
                                              for r in steady),
               stages=stages, generate_tokens_per_s=(tokens / gen_s) if gen_s else None,
               gpu_util=mean_util(gpu.between(w0, w1)),
               # Steps in which the trainer compiled graphs (algo.compile), step -> graphs: seconds a
               # measured step spends compiling are a warm-up gap, not the trainer's speed.
               compiled_in_steps={int(r["step"]): int(r["compiles"]) for r in rows if r.get("compiles")})
    return res


def stop_fleet(proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> bool:
    """End a measured `rlfleet up` at once: two SIGTERMs are its "kill the fleet now" (every service's
    process group, Redis, then its own exit), with no drain, final checkpoint or export. Falls back to
    killing the launcher's group. True once the launcher has exited."""
    import signal

    for _ in range(2):
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
    return proc.poll() is not None


def engine_start_s(run_dir: Path) -> float | None:
    """Seconds the actor's engine took to come up: its process's (`engine process started`), else vLLM's
    own line (`vLLM engine: ... started in 42.0s`) of an engine in the actor's process."""
    logs = sorted((run_dir / "logs").glob("actor*.log")) if (run_dir / "logs").is_dir() else []
    started = engine_process_s([r for log in logs for r in _records(log)])
    if started is not None:
        return started
    for log in logs:
        m = re.search(r"vLLM engine: .* started in ([0-9.]+)s", log.read_text(errors="replace"))
        if m:
            return float(m.group(1))
    return None


def engine_process_s(records: list[dict[str, Any]]) -> float | None:
    """Seconds the actor's engine process took to start (`engine process started`); with engine
    replicas, which start together and log one line each, the last one's."""
    started = [float(r["seconds"]) for r in records
               if r.get("msg") == "engine process started" and isinstance(r.get("seconds"), int | float)]
    return max(started) if started else None


def step_compiles(run_dir: Path) -> list[dict[str, Any]]:
    """Every `compiled during a step` record of the services (role, graphs, seconds and the guards that
    failed): which shapes or inputs the compile warm-up missed, read from the run itself."""
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    keep = ("role", "graphs", "seconds", "guard_failures")
    return [{k: r[k] for k in keep if k in r} for log in logs for r in _records(log)
            if r.get("msg") == "compiled during a step"]


def _records(log: Path) -> list[dict[str, Any]]:
    """A service log's JSON records (vLLM's and other libraries' plain lines are skipped)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _ts(rec: dict[str, Any]) -> float | None:
    try:
        return datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def startup_timeline(run_dir: Path, t0: float) -> dict[str, dict[str, float]]:
    """Where the time to first step goes: per service, seconds from the phase's launch to its first log
    record (its imports done) and to its `ready` state; the actor also gets its engine's start seconds,
    and the launcher (`launcher.log`) when it started the services and saw them all ready."""
    out: dict[str, dict[str, float]] = {}
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        recs = [(t, r) for r in _records(log) if (t := _ts(r)) is not None]
        if not recs:
            continue
        row = {"first_log_s": round(recs[0][0] - t0, 1)}
        ready = next((t for t, r in recs if r.get("msg") == "state changed" and r.get("to") == "ready"), None)
        if ready is not None:
            row["ready_s"] = round(ready - t0, 1)
        eng = engine_process_s([r for _, r in recs])
        if eng is not None:
            row["engine_s"] = eng
        # The actor's trainer, built and compiled while its engine starts.
        trainer = next((r.get("seconds") for _, r in recs if r.get("msg") == "trainer built while the engine starts"),
                       None)
        if isinstance(trainer, int | float):
            row["trainer_s"] = float(trainer)
        # The controller retries the trainables' GetState until they answer: the last failure is when
        # it could first reach them (on 2026-12-02, gRPC's reconnect backoff: 25-61 s after the actor
        # was ready).
        retried = [t for t, r in recs if r.get("msg") == "rpc failed, retrying"]
        if retried:
            row["last_rpc_retry_s"] = round(retried[-1] - t0, 1)
        # The launcher's own log: when it had passed preflight (its first record), started Redis and the
        # services, and saw them all ready.
        started = [t for t, r in recs if r.get("msg") == "service started"]
        if started:
            row["services_started_s"] = round(started[0] - t0, 1)
        ready_all = next((t for t, r in recs if r.get("msg") == "all services ready"), None)
        if ready_all is not None:
            row["ready_s"] = round(ready_all - t0, 1)
        out[log.stem] = row
    return out


VLLM_ALONE = r'''
import json, statistics, sys, time
from pathlib import Path
from services.models.io.loading import load_tokenizer
from services.models.engines.vllm_engine import VLLMEngine
from bench.vs_trl import W, synthetic_task
model, out, workload, opts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
tok = load_tokenizer(model)
task = synthetic_task(workload)
ids = [tok(task.prompt(i).text)["input_ids"] for i in range(W["prompts_per_step"])]
# The very engine rlfleet's actor starts (its options, environment and sampler), driven by vLLM's own
# LLM.generate with no rlfleet code in the loop; its compiled graphs are the fleet's, cached on the host.
llm = VLLMEngine.from_path(model, dtype="bfloat16", seed=0, **opts).llm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
prompts = [TokensPrompt(prompt_token_ids=p) for p in ids for _ in range(W["group"])]
res = {}
for name, kw in (("plain", {}), ("logprobs", {"logprobs": 0})):
    ps = SamplingParams(max_tokens=W["completion_tokens"], min_tokens=W["completion_tokens"], temperature=1.0,
                        detokenize=False, **kw)
    llm.generate(prompts, ps, use_tqdm=False)
    times, toks = [], []
    for _ in range(2):
        t = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        times.append(time.perf_counter() - t)
        toks.append(sum(len(o.outputs[0].token_ids) for o in outs))
    res[name] = {"seconds": times, "tokens": toks,
                 "tokens_per_s": statistics.median(n / s for n, s in zip(toks, times))}
    print(name, res[name]["tokens_per_s"], flush=True)
out.write_text(json.dumps(res))
'''


TRAIN_ALONE = r'''
import json, statistics, sys, time
import torch
from pathlib import Path
from services.core.config.run import parse_config
from services.dist.build import build_model, build_trainer
from services.models.io.loading import load_causal_lm
from services.reference.scorer import ReferenceScorer
from bench.rollouts import random_rollout
cfg, out, steps = parse_config(json.loads(sys.argv[1]), source="train-alone"), sys.argv[2], json.loads(sys.argv[3])
dev = cfg.endpoint("actor").device
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
# The actor's trainer and the reference service's scorer, built as those services build them, on one
# step's batch of the workload's shape (full-length responses, as min_tokens makes them), the GPU their own.
policy = build_model(cfg, "actor", dev)
trainer = build_trainer(cfg, "actor", policy)
a = cfg.algo
scorer = ReferenceScorer(load_causal_lm(Path(cfg.models.policy.path), dtype=cfg.models.policy.dtype, device=dev),
                         cfg.generation.temperature, micro_batch=a.micro_batch_size, micro_tokens=a.micro_batch_tokens,
                         pack=a.pack_sequences, chunk_tokens=a.logprob_chunk_tokens, compile=a.compile)
b = steps["rows"]
roll = random_rollout([steps["prompt_tokens"]] * b, [steps["completion_tokens"]] * b, int(policy.config.vocab_size),
                      low=4, group_size=a.group_size, advantages=True, versions=torch.zeros(b, dtype=torch.long))
res = {"train_s": [], "reference_s": []}
for i in range(steps["warmup"] + steps["steps"]):
    sync(); t = time.perf_counter()
    roll.ref_logprobs = scorer.score(roll)
    sync(); ref_s = time.perf_counter() - t
    t = time.perf_counter()
    # One version behind, as a batch of a fleet at max_staleness 1 reaches the trainer.
    trainer.train_step(roll, step=i, current_version=1)
    sync(); train_s = time.perf_counter() - t
    if i >= steps["warmup"]:
        res["train_s"].append(train_s); res["reference_s"].append(ref_s)
res.update(train_median_s=statistics.median(res["train_s"]), reference_median_s=statistics.median(res["reference_s"]),
           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.startswith("cuda") else None)
print("train", res["train_median_s"], "reference", res["reference_median_s"], flush=True)
open(out, "w").write(json.dumps(res))
'''


def phase_train_alone(p: Phase, cap: float, gpu: GpuSampler) -> dict[str, Any]:
    """The fleet repeats' trainer and reference scorer (configuration, model, micro-batches) on a batch of
    one step, each with the GPU to itself: how much of the fleet's `actor_train` and `reference` is their
    own work and how much is sharing the GPU with generation."""
    out, log = WORK / f"{p.name}.json", WORK / f"{p.name}.log"
    (rep1,) = select(f"fleet-{p.workload}-r1")
    cfg = fleet_config(rep1, model_dir(p.workload), 0)
    shape = {"rows": W["prompts_per_step"] * W["group"], "prompt_tokens": W["prompt_tokens"],
             "completion_tokens": W["completion_tokens"], "warmup": W["warmup"], "steps": W["steps"]}
    t0 = time.time()
    rc = run_proc([sys.executable, "-c", TRAIN_ALONE, json.dumps(cfg), str(out), json.dumps(shape)], log, cap,
                  env=phase_env(p))
    res: dict[str, Any] = {"rc": rc, "t0": t0, "t1": time.time(), "log_tail": tail(log)}
    if rc == 0 and out.exists():
        res.update(ok=True, **json.loads(out.read_text()))
    else:
        res["error"] = f"exit {rc}"
    return res


def engine_options(workload: str) -> dict[str, Any]:
    """`VLLMEngine.from_path` options of the fleet repeats' actor engine for `workload`."""
    from services.core.config.run import parse_config

    (rep1,) = select(f"fleet-{workload}-r1")
    cfg = parse_config(fleet_config(rep1, model_dir(workload), 0, dry=False), source=rep1.name)
    return cfg.generation.vllm.engine_options()


def phase_vllm_alone(p: Phase, cap: float, gpu: GpuSampler) -> dict[str, Any]:
    out, log = WORK / f"{p.name}.json", WORK / f"{p.name}.log"
    t0 = time.time()
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"rc": None, "t0": t0, "t1": t0, "error": "vllm is not installed"}
    rc = run_proc([sys.executable, "-c", VLLM_ALONE, str(model_dir(p.workload)), str(out), p.workload,
                   json.dumps(engine_options(p.workload))], log, cap, env=phase_env(p))
    res: dict[str, Any] = {"rc": rc, "t0": t0, "t1": time.time(), "log_tail": tail(log)}
    if out.exists():
        res.update(ok=True, variants=json.loads(out.read_text()))
    return res


# -- orchestration ----------------------------------------------------------------------------------
def framework(p: Phase) -> str:
    return "trl" if p.kind.startswith("trl") else "rlfleet"


def _home(p: Phase) -> Path:
    return WORK / "home" / framework(p)


def phase_env(p: Phase) -> dict[str, str]:
    """Each framework compiles into caches of its own: vLLM's graphs, Inductor's and Triton's kernels,
    FlashInfer's JIT (everything under a home of its own). Its first launch on the host compiles from
    cold, as a user's first run does, later launches load what it compiled, and no framework starts on
    kernels another one compiled (on 2026-12-02 TRL ran after rlfleet on one shared cache)."""
    home = _home(p)
    home.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    env.pop("VLLM_CACHE_ROOT", None)
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"),
               TRITON_CACHE_DIR=str(home / ".triton" / "cache"))
    return env


def vllm_compile_cache(p: Phase) -> set[str]:
    """vLLM's compiled-graph cache entries of `p`'s framework, one per model and engine configuration
    (its hash). A phase that adds one compiled from cold; one that adds none loaded its graphs."""
    cache = _home(p) / ".cache" / "vllm" / "torch_compile_cache"
    return {d.name for d in cache.iterdir()} if cache.is_dir() else set()


def uses_vllm(p: Phase) -> bool:
    return not DRY and (p.kind in ("trl-vllm", "vllm-alone") or (p.kind == "fleet" and p.engine == "vllm"))


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "trl", "vllm", "accelerate", "datasets"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:
            out[mod] = "absent"
    return out


def run_phase(p: Phase, cap: float, gpu: GpuSampler, done: dict[str, Any], index: int) -> dict[str, Any]:
    if p.kind in ("trl", "trl-vllm"):
        if DRY:  # both TRL phases of a dry run are the same CPU run (generate); the first one stands
            same = next((k for k, v in done.items() if v.get("kind_dry") == "trl" and v.get("ok")), None)
            if same:
                return {**done[same], "reused_from": same}
        return {**phase_trl(p, cap, gpu), "kind_dry": "trl"}
    if p.kind == "vllm-alone":
        return phase_vllm_alone(p, cap, gpu)
    if p.kind == "train-alone":
        same = next((k for k, v in done.items() if k.startswith("train-alone") and v.get("ok")), None) if DRY else None
        return {**done[same], "reused_from": same} if same else phase_train_alone(p, cap, gpu)
    if DRY:
        # What the GPU run will start must at least be a valid config: a wrong option fails here.
        from services.core.config.run import parse_config

        gpu_cfg = parse_config(fleet_config(p, model_dir(p.workload), 0, dry=False), source=p.name)
        checked = {"gpu_config_ok": True, "gpu_algo": gpu_cfg.algo.name, "gpu_engine": gpu_cfg.generation.engine}
        eff = _effective(fleet_config(p, model_dir(p.workload), 0))
        same = next((k for k, v in done.items() if v.get("effective") == eff and v.get("ok")), None)
        if same:
            return {**done[same], **checked, "reused_from": same}
        return {**phase_fleet(p, cap, gpu, port_base(index)), **checked}
    return phase_fleet(p, cap, gpu, port_base(index))


def port_base(index: int) -> int:
    """The first of a fleet phase's 20 fixed loopback ports, a range of its own per phase. Below Linux's
    ephemeral range (32768-60999): on 2026-12-04 a repeat's service could not bind its port in 51100+
    (EADDRINUSE), most likely taken meanwhile as the local end of some process's outgoing connection."""
    return 21100 + 20 * (index % 40)


def host_snapshot() -> dict[str, Any]:
    """What else the host was doing around a phase: load average, mean CPU clock and the processes with
    the highest CPU share over their lifetime (ps's %CPU). TRL with vLLM ran at 57.2 and 35.6 samples/s
    minutes apart on 2026-12-02, held on the CPU side in the slow run; this tells a busy or throttled
    host from a slow framework."""
    snap: dict[str, Any] = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        mhz = [float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines()
               if ln.startswith("cpu MHz")]
        snap["cpu_mhz"] = round(statistics.fmean(mhz)) if mhz else None
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,etimes,comm", "--sort=-pcpu", "--no-headers"],
                            capture_output=True, text=True, timeout=10).stdout
        snap["busiest"] = [" ".join(ln.split()) for ln in ps.splitlines()[:6]]
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return snap


def cpu_topology() -> dict[str, Any]:
    """Which CPUs the phases may run on, the host's NUMA nodes and the CPUs local to each NVIDIA GPU.
    TRL with vLLM, one process launching small kernels, varied by a third from run to run on a quiet
    host on 2026-12-02 (16:42 run); a process scheduled away from the GPU's node is one suspect."""
    def cpulist(path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    gpus = [d for d in Path("/sys/bus/pci/devices").glob("*")
            if cpulist(d / "vendor") == "0x10de" and (cpulist(d / "class") or "").startswith("0x03")]
    return {"cpus_allowed": len(os.sched_getaffinity(0)),
            "numa_nodes": {n.name: cpulist(n / "cpulist") for n in nodes},
            "gpu_local_cpus": {d.name: cpulist(d / "local_cpulist") for d in sorted(gpus)}}


SERVICE_MODULES = tuple(f"services.{n}.server" for n in PORTS)
IMPORT_CHECK = r'''
import importlib, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except ImportError as e:
        print(f"{m}: {e}")
'''


def missing_modules(dry: bool = DRY) -> list[str]:
    """What the phases would die of at start-up, found in a few seconds instead of one phase at a time:
    every service's imports (a fresh GPU host lacks whatever its wheelhouse forgot), and vLLM and TRL."""
    mods = [*SERVICE_MODULES, "bench.trl_peer", *(() if dry else ("vllm", "trl"))]
    p = subprocess.run([sys.executable, "-c", IMPORT_CHECK, *mods], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    return [ln for ln in p.stdout.splitlines() if ln] or ([f"import check failed: {p.stderr.strip()[-300:]}"]
                                                           if p.returncode else [])


def cmd_run(args: argparse.Namespace) -> int:
    if args.steps is not None:
        if args.steps < 2:
            print(f"vs_trl: --steps must be >= 2 (a median and a spread), got {args.steps}", file=sys.stderr)
            return 2
        W["steps"] = args.steps
    chosen = select(args.phases or args.only)
    print_plan(chosen, args.deadline_s)
    bad = missing_modules()
    if bad:
        print(f"vs_trl: cannot run, missing on this host: {'; '.join(bad)}", file=sys.stderr)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    gpu = GpuSampler()
    gpu.start()
    result: dict[str, Any] = {"command": " ".join(["python -m bench.vs_trl", *sys.argv[1:]]), "dry": DRY,
                              "gpu": gpu.name or "none", "versions": versions(), "workload": W,
                              "shapes": SHAPES, "cpu_topology": cpu_topology(),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": {},
                              "plan": {p.name: {"group": p.group, "est_s": p.est_s} for p in chosen}}
    for w in dict.fromkeys(p.workload for p in chosen):
        say(f"building the {w} model")
        build_model(w)
    gpu.mark_idle()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"vs_trl-{stamp}.json"
    for i, p in enumerate(chosen):
        left = args.deadline_s - (time.monotonic() - start)
        # A phase cut off at the deadline measures nothing and costs device time; a dry run's phases
        # take seconds, whatever the GPU estimates say.
        if left < (min(p.est_s, 60) if DRY else p.est_s):
            result["phases"][p.name] = {"skipped": f"{left:.0f} s left of the {args.deadline_s:.0f} s deadline"}
            continue
        say(f"phase {p.name} (estimate {p.est_s:.0f} s, {left:.0f} s left)")
        cached = vllm_compile_cache(p) if uses_vllm(p) else set()
        before = host_snapshot()
        try:
            result["phases"][p.name] = run_phase(p, min(max(p.est_s * 2.5, 60), left - 10), gpu,
                                                 result["phases"], i)
        except Exception as err:  # one broken phase must not cost the others
            result["phases"][p.name] = {"error": f"{type(err).__name__}: {err}"}
        ph = result["phases"][p.name]
        ph["host"] = {"before": before, "after": host_snapshot()}
        if uses_vllm(p):
            ph["vllm_compile"] = "cold" if vllm_compile_cache(p) - cached else "cached"
        ph["seconds"] = time.time() - float(ph.get("t0", time.time()))
        say(f"phase {p.name}: " + json.dumps({k: ph.get(k) for k in ("rc", "ok", "samples_per_s", "gpu_util",
                                                                      "first_step_s", "error", "reused_from")}))
        result["gpu_samples"] = gpu.samples
        path.write_text(json.dumps(result, default=str))  # after every phase: a cut-off run keeps what it has
    gpu.stop.set()
    result["gpu_samples"] = gpu.samples
    result["wall_s"] = time.monotonic() - start
    path.write_text(json.dumps(result, default=str))
    say(f"wrote {path} after {result['wall_s']:.0f} s")
    from bench.vs_trl_report import report

    report([path], args.out, update_benchmarks=args.update_benchmarks)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="print the phases, their groups and estimated seconds")
    pl.add_argument("--phases", default=None)
    r = sub.add_parser("run", help="run the chosen phases (GPU host), then write the report")
    r.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    r.add_argument("--deadline-s", type=float, default=570.0,
                   help="bound on the whole call; a phase that would start too late is skipped")
    r.add_argument("--phases", default=None,
                   help=f"comma-separated phases or groups (default: {','.join(DEFAULT_GROUPS)}; 'all')")
    r.add_argument("--steps", type=int, default=None,
                   help=f"measured steps per phase after the warm-up ones (default {W['steps']}); more cost device"
                        " time and narrow a median of steps whose times vary")
    r.add_argument("--only", default=None, help=argparse.SUPPRESS)  # the issue-7 spelling of --phases
    r.add_argument("--update-benchmarks", action="store_true", help="rewrite the section in BENCHMARKS.md")
    rep = sub.add_parser("report", help="merge results JSONs, render BENCHMARKS.md's section and the plots")
    rep.add_argument("--results", type=Path, nargs="+", required=True)
    rep.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    rep.add_argument("--update-benchmarks", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        print_plan(select(args.phases), float("inf"))
        return 0
    if args.cmd == "run":
        return cmd_run(args)
    from bench.vs_trl_report import report

    report(args.results, args.out, args.update_benchmarks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
