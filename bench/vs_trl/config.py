"""The `rlfleet up` config of a fleet phase: rlfleet's configuration for this workload, per shape and
per lever, the dry run's CPU stand-in, and each phase's own loopback ports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.vs_trl.phases import Phase, select
from bench.vs_trl.workload import DRY, N_SPECIAL, SHAPES, WORK, W, model_dir

PORTS = {"controller": 0, "actor": 1, "critic": 2, "reward": 3, "reference": 4}


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


# What a CPU dry run can start: no vLLM (its options are refused by the transformers engine) and no
# inductor (minutes per graph on two cores; tests/unit/test_trainer_levers.py checks compile).
DRY_LEVERS = {"logprob_chunk_tokens": 2}


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


def effective(cfg: dict[str, Any]) -> str:
    """A fleet's configuration without what only names it (run name/dir, ports): equal means same run."""
    c = json.loads(json.dumps(cfg))
    c["run"].pop("name")
    c["run"].pop("dir")
    c.pop("services")
    return json.dumps(c, sort_keys=True)


def port_base(index: int) -> int:
    """The first of a fleet phase's 20 fixed loopback ports, a range of its own per phase. Below Linux's
    ephemeral range (32768-60999): on 2026-12-04 a repeat's service could not bind its port in 51100+
    (EADDRINUSE), most likely taken meanwhile as the local end of some process's outgoing connection."""
    return 21100 + 20 * (index % 40)


def engine_options(workload: str) -> dict[str, Any]:
    """`VLLMEngine.from_path` options of the fleet repeats' actor engine for `workload`."""
    from services.core.config.run import parse_config

    (rep1,) = select(f"fleet-{workload}-r1")
    cfg = parse_config(fleet_config(rep1, model_dir(workload), 0, dry=False), source=rep1.name)
    return cfg.generation.vllm.engine_options()
