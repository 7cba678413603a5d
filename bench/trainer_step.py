"""Where an rlfleet GRPO step of the learning benchmark goes, on one GPU (issue 32).

    python -m bench.learn prepare && python -m bench.trainer_step --task chain_sum --out OUT.json   # GPU host
    BENCH_DRY=1 python -m bench.trainer_step --out /tmp/step.json     # CPU dry run (tiny model, no vLLM)

`bench.learn`'s workload (its model, task, algo and engine settings), one step of it taken apart: the
actor's engine started as the fleet's actor starts it (vLLM in its own process) generates one step's
prompts (32 x 8 completions of at most 24 tokens) a few times, alone, then again while the trainer
trains, as the fleet's steps overlap at `max_staleness: 1`; the weight sync into it is timed on its own.
Its completions, with their engine log-probs and one version behind, are the batch the trainer
(`PolicyTrainer`, built by `services.dist.build` as the actor builds it) then trains on in each variant
(`VARIANTS`: micro-batch 64 as the benchmark runs it, 128 and 256; TF32 off; bf16 autocast;
torch.compile), each on a
fresh copy of the model, timed over `--steps` steps after two warm ones, with a torch.profiler summary
of one step: the GPU's busy time against the step's wall time says whether the step waits on the GPU
or on the Python that launches its kernels. Results are written after every phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from bench import common, learn
from bench.vs_trl.gpu import GpuSampler, mean_util

say = partial(common.say, tag="trainer_step", err=True)

# name -> algo overrides on top of bench.learn's (micro_batch_size 64, eager, TF32 on a GPU).
VARIANTS: dict[str, dict[str, Any]] = {
    "mb64": {},
    "mb128": {"micro_batch_size": 128},
    "mb256": {"micro_batch_size": 256},
    "mb64-fp32": {"tf32": False},
    "mb256-fp32": {"micro_batch_size": 256, "tf32": False},
    "mb64-bf16": {"autocast": "bfloat16"},
    "mb256-bf16": {"micro_batch_size": 256, "autocast": "bfloat16"},
    "mb64-compiled": {"compile": True},
    "mb256-compiled": {"compile": True, "micro_batch_size": 256},
}


def run_config(task: str) -> Any:
    from services.core.config.run import RunConfig

    learn.W["task"] = task
    model = learn.prepare()
    cfg = learn.run_config(model, learn.WORK / "trainer-step-run")
    return RunConfig.model_validate(cfg)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch_of(prompts: list[list[int]], comps: list[Any], group: int, pad: int, version: int) -> Any:
    """The rollout the controller would send: prompts left-padded, responses right-padded, engine
    log-probs, GRPO advantages of a made-up 0/1 reward (the step's cost does not depend on them), every
    row one version behind the trainer's."""
    import torch

    from services.rl.batch import Rollout

    b = len(comps)
    p = max(len(x) for x in prompts)
    r = max(1, max(len(c.token_ids) for c in comps))
    prompt_ids = torch.full((b, p), pad, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.bool)
    response_ids = torch.full((b, r), pad, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.bool)
    behaviour = torch.zeros(b, r)
    for i, (x, c) in enumerate(zip(prompts, comps, strict=True)):
        prompt_ids[i, p - len(x):] = torch.tensor(x)
        prompt_mask[i, p - len(x):] = True
        n = len(c.token_ids)
        response_ids[i, :n] = torch.tensor(c.token_ids)
        response_mask[i, :n] = True
        behaviour[i, :n] = torch.tensor(list(c.logprobs)[:n])
    g = torch.Generator().manual_seed(0)
    reward = (torch.rand(b, generator=g) < 0.4).float().view(-1, group)
    adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    return Rollout(task_ids=[f"t{i}" for i in range(b)], prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   response_ids=response_ids, response_mask=response_mask, behaviour_logprobs=behaviour,
                   group_ids=torch.arange(b) // group, version=version - 1,
                   advantages=adv * response_mask, versions=torch.full((b,), version - 1))


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def profile_step(fn: Callable[[], Any], device: str) -> dict[str, Any]:
    """One call of `fn` under torch.profiler: wall time, the GPU kernels' summed time (busy), and the
    operators that took most of it; on the CPU the CPU operators instead."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy_us = sum(getattr(e, attr, 0.0) for e in events if not cuda or getattr(e, "device_type", None)
                  == torch.autograd.DeviceType.CUDA) if cuda else None
    kernels = sum(e.count for e in events if cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    top = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:15]
    return {"wall_s": round(wall, 4), "gpu_busy_s": None if busy_us is None else round(busy_us / 1e6, 4),
            "kernels": kernels,
            "top": [{"op": e.key[:80], "count": e.count, "s": round(getattr(e, attr, 0.0) / 1e6, 4)} for e in top]}


def stepper(trainer: Any, batch: Any) -> Callable[[], dict[str, float]]:
    """One train_step per call on `batch`, the step number counting up, the batch one version behind."""
    steps = iter(range(1, 1_000_000))
    return lambda: trainer.train_step(batch, next(steps), current_version=2)


def timed(one: Callable[[], Any], steps: int, device: str, gpu: GpuSampler) -> dict[str, Any]:
    """`steps` steps, each waited for; their median and range, and NVML's mean utilisation meanwhile."""
    times = []
    stats: dict[str, float] = {}
    sync(device)
    start = time.time()
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = one()
        sync(device)
        times.append(time.perf_counter() - t0)
    util = mean_util(gpu.between(start, time.time()))
    return {"train_step": spread(times), "gpu_util": None if util is None else round(util, 1),
            "compiles": stats.get("compiles")}


def overlapped(engine: Any, prompts: list[list[int]], params: Any, one: Callable[[], Any],
               device: str, rounds: int = 3) -> dict[str, Any]:
    """Generation in a thread while the trainer trains, as the fleet's steps overlap at max_staleness 1
    (the engine's own process does the work; this thread only waits on it)."""
    gen_s: list[float] = []
    train_s: list[float] = []

    def gen() -> None:
        t1 = time.perf_counter()
        engine.generate(prompts, params)
        gen_s.append(time.perf_counter() - t1)

    for _ in range(rounds):
        th = threading.Thread(target=gen)
        t1 = time.perf_counter()
        th.start()
        one()
        sync(device)
        train_s.append(time.perf_counter() - t1)
        th.join()
    return {"generate": spread(gen_s), "train_step": spread(train_s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.trainer_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="chain_sum", choices=sorted(learn.TASKS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant, after two warm ones")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench.trainer_step: unknown variant(s) {', '.join(unknown)}:"
                         f" pick from {', '.join(VARIANTS)}")
    if args.steps < 1:
        raise SystemExit(f"bench.trainer_step: --steps must be >= 1, got {args.steps}")

    import torch

    from services.dist.build import build_model, build_trainer
    from services.models.engine import SamplingParams
    from services.models.engines.factory import make_engine
    from services.models.nets.lora import engine_weights
    from services.rl.trainer import PolicyTrainer
    from services.tasks.chat import encode_prompts

    res: dict[str, Any] = {"task": args.task, "device": learn._device_name(), "variants": {}}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))

    gpu = GpuSampler(period=0.02)  # NVML utilisation while the variants' steps run (none without NVML)
    gpu.start()
    cfg = run_config(args.task)
    task, tok, _ = learn.load_task(learn.run_config(Path(str(cfg.models.policy.path)), cfg.run.dir))
    device = cfg.endpoint("actor").device
    group, n_prompts = cfg.algo.group_size, cfg.batch.prompts_per_step
    prompts = [p for p in encode_prompts(task, tok, range(n_prompts)) for _ in range(group)]
    g = cfg.generation
    params = SamplingParams(temperature=g.temperature, max_new_tokens=g.max_new_tokens, seed=cfg.run.seed)
    t0 = time.perf_counter()
    engine = make_engine(g.engine, Path(str(cfg.models.policy.path)), dtype=g.engine_dtype(cfg.models.policy.dtype),
                         **g.engine_kwargs(cfg.run.dir))
    res["engine_start_s"] = round(time.perf_counter() - t0, 2)
    say(f"engine started in {res['engine_start_s']} s")
    try:
        comps = engine.generate(prompts, params)  # warm: the allocator's pools, the sampler's first call
        gen_s, tokens = [], []
        for i in range(4):
            t0 = time.perf_counter()
            comps = engine.generate(prompts, replace(params, seed=cfg.run.seed + i))
            gen_s.append(time.perf_counter() - t0)
            tokens.append(sum(len(c.token_ids) for c in comps))
        res["generate_alone"] = {**spread(gen_s), "response_tokens": statistics.median(tokens)}
        say("generate alone", res["generate_alone"])
        # As an actor with generation.batch_messages 1 generates a step: one engine call per prompt message,
        # one after the other, so a step of four messages is four calls of 64 rows (the default actor
        # generates the messages that wait together in one call: `generate_alone`).
        per = cfg.batch.prompts_per_message * group
        msg_s = []
        for i in range(4):
            t0 = time.perf_counter()
            for k in range(0, len(prompts), per):
                engine.generate(prompts[k:k + per], replace(params, seed=cfg.run.seed + i, first_row=k))
            msg_s.append(time.perf_counter() - t0)
        res["generate_in_messages"] = {**spread(msg_s), "messages": -(-len(prompts) // per), "rows_per_message": per}
        say("generate in messages", res["generate_in_messages"])
        write()

        pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        batch = batch_of(prompts, comps, group, pad, version=2)
        res["batch"] = {"rows": len(batch), "prompt_width": int(batch.prompt_ids.shape[1]),
                        "response_width": int(batch.response_ids.shape[1]),
                        "response_tokens": int(batch.response_mask.sum()),
                        "prompt_tokens": int(batch.prompt_mask.sum())}

        def trainer_for(name: str) -> Any:
            algo = cfg.algo.model_copy(update=VARIANTS[name])
            c = cfg.model_copy(update={"algo": algo})
            model: Any = build_model(c, "actor", device)
            trainer = build_trainer(c, "actor", model)
            assert isinstance(trainer, PolicyTrainer)
            if algo.compile:  # as the actor warms up: the step's largest micro-batch, before the first step
                t0 = time.perf_counter()
                trainer.warm_up(int(model.config.vocab_size), False, len(batch), g.max_new_tokens)
                res["variants"].setdefault(name, {})["compile_s"] = round(time.perf_counter() - t0, 1)
            return model, trainer

        for name in names:
            model, trainer = trainer_for(name)
            one = stepper(trainer, batch)
            for _ in range(2):
                one()
            v = res["variants"].setdefault(name, {})
            v.update(timed(one, args.steps, device, gpu))
            v["profile"] = profile_step(one, device)
            if name == names[0]:  # the weight sync as the actor makes it after a step, then both at once
                weights = list(engine_weights(model))
                syncs = []
                for k in range(3):
                    t1 = time.perf_counter()
                    engine.update_weights(weights, 100 + k)
                    syncs.append(time.perf_counter() - t1)
                res["weight_sync"] = spread(syncs)
                res["overlapped"] = overlapped(engine, prompts, params, one, device)
                say("overlapped", res["overlapped"])
                del weights
            say(name, {k: v[k] for k in ("train_step", "gpu_util")},
                "gpu busy", v["profile"]["gpu_busy_s"], "of", v["profile"]["wall_s"], "s")
            del model, trainer, one
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            write()
    finally:
        gpu.stop.set()
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
