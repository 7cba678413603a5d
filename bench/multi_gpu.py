"""Decoupled placement on one multi-GPU host (issue 15), ready for the first 8-GPU session: the actor on
some GPUs (trainer ranks + vLLM engine replicas), the critic on others, reward and reference on the
rest, against TRL on the same GPUs.

    python -m bench.multi_gpu plan --gpus 8 --out DIR           # the config + `rlfleet plan` of it
    python -m bench.multi_gpu run --gpus 8 --out DIR [--phases fleet,trl] [--steps N]
    BENCH_DRY=1 python -m bench.multi_gpu run --out DIR        # CPU dry run: tiny model, no GPU, measures nothing

Phases (each its own process tree, results in DIR/multi-gpu-<phase>.json, summary DIR/multi-gpu.json):

- `plan`: writes DIR/multi-gpu.yaml, the PPO fleet config with device groups by count (actor half the
  GPUs, critic a quarter, reward + reference the last quarter, one reward replica per GPU there),
  `generation.replicas` = the actor's GPUs (one vLLM replica per GPU, tensor_parallel_size 1), and
  runs `rlfleet plan --json --k8s-patch` on it (NVML on the host; a synthetic inventory in the dry run).
- `fleet`: `rlfleet up` on that config; seconds per step (median over the steps after warm-up),
  generated tokens/s, per-replica tokens/s from the actor's status.
- `trl`: TRL GRPO (bench/trl_peer.py) on the same GPUs, data parallel with `torchrun --nproc-per-node`
  (the dry run: one CPU process).

What is not measured here, and why: nothing of this has run on a multi-GPU host yet (none was
available); the figures come from the first session that has one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import read_rows, say

REPO = Path(__file__).resolve().parents[1]
DRY = os.environ.get("BENCH_DRY") == "1"
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/multi-gpu-work"))
W: dict[str, int] = dict(prompts_per_step=64, group=8, prompt_tokens=64, completion_tokens=256, steps=10, warmup=2)
if DRY:
    W.update(prompts_per_step=4, group=2, prompt_tokens=4, completion_tokens=4, steps=2, warmup=1)
PHASES = ("plan", "fleet", "trl")


def split(gpus: int) -> dict[str, int]:
    """GPUs per group: actor half, critic a quarter, scorers the rest (at least one each)."""
    if gpus < 3:
        raise SystemExit(f"decoupled placement needs at least 3 GPUs (actor, critic, scorers); got {gpus}")
    actor = max(1, gpus // 2)
    critic = max(1, (gpus - actor) // 2)
    return {"train": actor, "value": critic, "score": gpus - actor - critic}


def config(gpus: int, model: Path, run_dir: Path) -> dict[str, Any]:
    g = split(gpus)
    device = "cpu" if DRY else "cuda"
    services: dict[str, Any] = {
        # One trainer rank per GPU of each group (FSDP2 over the group); the dry run stays on one rank.
        "actor": {"device_group": "train", "device": device, "trainer_ranks": 1 if DRY else g["train"]},
        "critic": {"device_group": "value", "device": device, "trainer_ranks": 1 if DRY else g["value"]},
        "reward": {"device_group": "score", "device": device, "replicas": g["score"]},
        "reference": {"device_group": "score", "device": device},
    }
    return {
        "run": {"name": "multi_gpu", "dir": str(run_dir), "seed": 0, "max_steps": W["warmup"] + W["steps"]},
        "task": {"name": "synthetic", "eval_size": 0,
                 "params": {"prompt_tokens": W["prompt_tokens"], "completion_tokens": W["completion_tokens"]}},
        "models": {"policy": {"path": str(model), "dtype": "float32" if DRY else "bfloat16"}},
        "algo": {"name": "ppo", "group_size": W["group"], "kl_coef": 0.04, "kl_in": "loss", "ppo_epochs": 1,
                 "minibatch_size": W["prompts_per_step"] * W["group"]},
        "generation": {"engine": "transformers" if DRY else "vllm", "device": device, "process": True,
                       "replicas": 1 if DRY else g["train"], "max_new_tokens": W["completion_tokens"],
                       "vllm": {"gpu_memory_utilization": 0.35, "max_model_len": 1024}},
        "batch": {"prompts_per_step": W["prompts_per_step"], "prompts_per_message": W["prompts_per_step"] // 4 or 1},
        "devices": {name: {"count": n} for name, n in g.items()},
        "services": services,
        "flow": {"max_staleness": 1, "resend_after_s": 900.0, "rpc_timeout_s": 900.0},
        "checkpoint": {"every": 1000},
    }


def model_dir() -> Path:
    """The policy: a Qwen2.5-0.5B-shaped random model (bench.replica_check's), tiny in the dry run."""
    from bench.replica_check import build_model

    return build_model(WORK / "model")


def _inventory(gpus: int) -> Path | None:
    if not DRY:
        return None  # NVML on the host
    path = WORK / "inventory.yaml"
    path.write_text(yaml.safe_dump({"gpus": [{"index": i, "name": "NVIDIA H200", "memory_gb": 141, "arch": "hopper",
                                              "uuid": f"GPU-dry-{i}"} for i in range(gpus)]}))
    return path


def phase_plan(gpus: int, out: Path) -> dict[str, Any]:
    cfg_path = out / "multi-gpu.yaml"
    cfg = config(gpus, WORK / "model", WORK / "run")  # built by the phases that run it
    if DRY:  # a CPU run cannot pin GPUs: plan the groups, then run without them
        planned = dict(cfg)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "services.cli", "plan", "--config", str(cfg_path), "--json",
           "--k8s-patch", str(out / "multi-gpu.k8s-patch.yaml")]
    inv = _inventory(gpus)
    if inv is not None:
        cmd += ["--inventory", str(inv)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr or p.stdout)[-2000:]}
    if DRY:
        for svc in planned["services"].values():
            svc.pop("device_group", None)
        planned.pop("devices")
        cfg_path.write_text(yaml.safe_dump(planned, sort_keys=False))
    return {"ok": True, "config": str(cfg_path), "plan": json.loads(p.stdout)}


def phase_fleet(out: Path, cap_s: float) -> dict[str, Any]:
    cfg_path = out / "multi-gpu.yaml"
    if not cfg_path.exists():
        return {"ok": False, "error": "run the plan phase first"}
    run_dir = Path(yaml.safe_load(cfg_path.read_text())["run"]["dir"])
    model_dir()
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "services.cli", "up", "--config", str(cfg_path)]
    say("$", " ".join(cmd))
    t0 = time.monotonic()
    with (out / "multi-gpu-fleet.log").open("w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=cap_s)
    rows = read_rows(run_dir / "metrics.jsonl")
    steady = [r for r in rows if int(r["step"]) > W["warmup"]]
    secs = [float(r["step_s"]) for r in steady if "step_s" in r]
    tps = [float(r["tokens_per_s"]) for r in steady if "tokens_per_s" in r]
    return {"ok": p.returncode == 0 and len(rows) == W["warmup"] + W["steps"], "returncode": p.returncode,
            "wall_s": round(time.monotonic() - t0, 1), "steps": len(rows),
            "median_step_s": statistics.median(secs) if secs else None,
            "median_tokens_per_s": statistics.median(tps) if tps else None}


def phase_trl(gpus: int, out: Path, cap_s: float) -> dict[str, Any]:
    res = out / "multi-gpu-trl-peer.json"
    peer = ["-m", "bench.trl_peer", "--model", str(model_dir()), "--out", str(res), "--steps", str(W["steps"]),
            "--warmup", str(W["warmup"]), "--prompts-per-step", str(W["prompts_per_step"]), "--group", str(W["group"]),
            "--prompt-tokens", str(W["prompt_tokens"]), "--completion-tokens", str(W["completion_tokens"])]
    if DRY:
        cmd = [sys.executable, *peer, "--device", "cpu", "--micro-batch", str(W["prompts_per_step"] * W["group"])]
    else:  # data parallel over every GPU the fleet used, one process per GPU
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *peer]
    say("$", " ".join(cmd))
    with (out / "multi-gpu-trl.log").open("w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=cap_s)
    peer_out = json.loads(res.read_text()) if res.exists() else {}
    return {"ok": p.returncode == 0 and bool(peer_out.get("ok", False)), "returncode": p.returncode,
            "peer": {k: v for k, v in peer_out.items() if k != "steps"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.multi_gpu")
    ap.add_argument("command", choices=("plan", "run"))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)} (run only)")
    ap.add_argument("--cap-s", type=float, default=540.0, help="wall-clock cap per phase")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    phases = ["plan"] if a.command == "plan" else [p for p in a.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        print(f"bench.multi_gpu: unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}", file=sys.stderr)
        return 2
    summary: dict[str, Any] = {"dry": DRY, "gpus": a.gpus, "groups": split(a.gpus), "workload": W}
    for ph in phases:
        say("phase", ph)
        try:
            r = (phase_plan(a.gpus, a.out) if ph == "plan" else phase_fleet(a.out, a.cap_s) if ph == "fleet"
                 else phase_trl(a.gpus, a.out, a.cap_s))
        except subprocess.TimeoutExpired:
            r = {"ok": False, "error": f"over the {a.cap_s:g} s cap"}
        (a.out / f"multi-gpu-{ph}.json").write_text(json.dumps(r, indent=2, default=str))
        summary[ph] = {k: v for k, v in r.items() if k != "plan"}
        say(ph, "ok" if r.get("ok") else f"FAILED: {str(r.get('error', ''))[:300]}")
    (a.out / "multi-gpu.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0 if all(summary[p].get("ok") for p in phases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
