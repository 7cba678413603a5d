"""The runners of the phases but the fleet's (`fleet_run`): TRL (with vLLM or `generate`), vLLM alone,
the trainer and reference alone; and `run_phase`, which picks a phase's runner (a dry run reuses
the run of a phase that ran the same)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.vs_trl.caches import phase_env
from bench.vs_trl.children import TRAIN_ALONE, VLLM_ALONE
from bench.vs_trl.config import effective, engine_options, fleet_config, port_base
from bench.vs_trl.fleet_run import phase_fleet
from bench.vs_trl.gpu import GpuSampler, mean_util
from bench.vs_trl.logs import trl_stages
from bench.vs_trl.phases import Phase, select
from bench.vs_trl.procs import run_proc, tail
from bench.vs_trl.workload import DRY, N_SPECIAL, SHAPES, WORK, W, model_dir


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
               stages=trl_stages(steps))
    return res


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
        eff = effective(fleet_config(p, model_dir(p.workload), 0))
        same = next((k for k, v in done.items() if v.get("effective") == eff and v.get("ok")), None)
        if same:
            return {**done[same], **checked, "reused_from": same}
        return {**phase_fleet(p, cap, gpu, port_base(index)), **checked}
    return phase_fleet(p, cap, gpu, port_base(index))
