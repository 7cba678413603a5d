"""Peer baseline: TRL's `GRPOTrainer` on the workload rlfleet is benchmarked on, in its own process.

    python -m bench.trl_peer --model DIR --out trl.json [--steps 10 --warmup 2 --prompts-per-step 32 --group 8]

What is measured: wall-clock seconds per optimizer step of TRL GRPO (TRL 1.16), where ONE optimizer step
consumes exactly one generation round of P prompts x G completions (generation with `model.generate`, or
vLLM colocated with `--use-vllm`, then reward, reference/old log-probs, P*G/M micro-batches of forward +
backward, one AdamW step). Prompts are `SyntheticTask` prompts (exactly `--prompt-tokens` one-token words
each) and the reward is `SyntheticTask.reward`, the same function rlfleet's reward service computes.

How: a `TrainerCallback` takes `time.perf_counter()` and `time.time()` at `on_step_begin` / `on_step_end`
(after a CUDA synchronize, so queued kernels are charged to the step that launched them) and keeps TRL's
per-step logged metrics. TRL's own profiling timers (generate, reward, ...) only report to wandb/mlflow/
trackio, so they are tapped in-process and stored per step under `profile`. Completion tokens per step come
from TRL's logged `completions/mean_length` x completions when present, else from the token budget; the
JSON says which. Steady-state figures drop the first `--warmup` steps: median step seconds, completions per
step / median, completion tokens per step / median. One JSON file is written (with `"ok": false` and the
error on failure, then a non-zero exit) and one JSON summary line is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench import common

# The GPU host has no internet: a hub lookup would hang on timeouts instead of failing. Everything this
# script loads is a local directory. Set before transformers/datasets/trl are imported.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Word-level tokenizers of rlfleet's tiny/synthetic models reserve ids 0..3 for special tokens.
N_SPECIAL = 4


class PeerError(RuntimeError):
    """A setup or consistency failure; the message says what and why."""


say = partial(common.say, tag="trl_peer", err=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.trl_peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="saved causal LM directory that also holds its tokenizer")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--steps", type=int, default=10, help="measured optimizer steps")
    ap.add_argument("--warmup", type=int, default=2, help="optimizer steps run first and excluded from steady state")
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (TRL num_generations)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--completion-tokens", type=int, default=256)
    ap.add_argument("--words", type=int, default=None,
                    help="synthetic word vocabulary size (default: tokenizer size minus its 4 special tokens)")
    ap.add_argument("--micro-batch", type=int, default=32, help="TRL per_device_train_batch_size")
    ap.add_argument("--kl-coef", type=float, default=0.04, help="TRL beta")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    ap.add_argument("--use-vllm", action="store_true", help="generate with vLLM colocated in this process")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    args = ap.parse_args(argv)
    for name in ("steps", "prompts_per_step", "group", "prompt_tokens", "completion_tokens", "micro_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.group < 2:
        ap.error("--group must be >= 2 (GRPO needs at least 2 completions per prompt for an advantage)")
    per_step = args.prompts_per_step * args.group
    if per_step % args.micro_batch != 0:
        ap.error(f"--prompts-per-step x --group = {per_step} completions per step must be divisible by "
                 f"--micro-batch {args.micro_batch}, so that one optimizer step consumes exactly one generation round")
    return args


# ---- pure helpers (unit-tested without TRL) ----

def steady_state(steps: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Steady-state figures over `steps` after the first `warmup` ones.

    samples/s and tokens/s divide the median per-step work by the median step time (robust to a single
    slow step, e.g. an allocator growth or a GC pause); `window_*` divide the total work by the span from
    the first measured step's begin to the last one's end, so they also charge what runs between steps
    (Trainer logging, the next batch fetch).
    """
    measured = list(steps[warmup:])
    if not measured:
        return {"steps_measured": 0, "median_step_s": None, "samples_per_s": None, "tokens_per_s": None,
                "window_s": None, "window_samples_per_s": None, "window_tokens_per_s": None}
    med_s = statistics.median(float(s["seconds"]) for s in measured)
    med_n = statistics.median(float(s["completions"]) for s in measured)
    med_tok = statistics.median(float(s["completion_tokens"]) for s in measured)
    window = float(measured[-1]["t_end"]) - float(measured[0]["t_begin"])
    tot_n = sum(float(s["completions"]) for s in measured)
    tot_tok = sum(float(s["completion_tokens"]) for s in measured)
    return {
        "steps_measured": len(measured),
        "median_step_s": med_s,
        "samples_per_s": med_n / med_s if med_s > 0 else None,
        "tokens_per_s": med_tok / med_s if med_s > 0 else None,
        "window_s": window,
        "window_samples_per_s": tot_n / window if window > 0 else None,
        "window_tokens_per_s": tot_tok / window if window > 0 else None,
    }


def completion_tokens_of(logs: dict[str, Any], completions: int, budget: int) -> tuple[int, str]:
    """Completion tokens of one step and where the count came from."""
    mean_len = logs.get("completions/mean_length")
    if isinstance(mean_len, int | float) and math.isfinite(mean_len):
        return round(float(mean_len) * completions), "trl_logged_mean_length"
    return completions * budget, "budget"


def json_safe(value: Any) -> Any:
    """Plain JSON: non-finite floats become null (json.dumps would write bare NaN), tensors become numbers."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item"):
        try:
            return json_safe(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(payload), indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


# ---- measurement ----

class StepRecorder:
    """Per-optimizer-step timestamps, TRL logs and tapped TRL profiling durations."""

    def __init__(self, sync: Callable[[], None]):
        self._sync = sync
        self.steps: dict[int, dict[str, Any]] = {}
        self.current: int | None = None
        self.profile: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.train_summary: dict[str, Any] = {}

    def begin(self, step: int) -> None:
        self._sync()
        self.current = step
        self.steps[step] = {"step": step, "t_begin": time.perf_counter(), "wall_begin": time.time()}

    def end(self, step: int) -> None:
        self._sync()
        rec = self.steps.setdefault(step, {"step": step})
        rec["t_end"] = time.perf_counter()
        rec["wall_end"] = time.time()
        self.current = None

    def log(self, step: int, logs: dict[str, Any]) -> None:
        if "train_runtime" in logs:  # Trainer's end-of-training summary, not a step's metrics
            self.train_summary = dict(logs)
            return
        self.steps.setdefault(step, {"step": step}).setdefault("logs", {}).update(logs)

    def profiled(self, name: str, seconds: float) -> None:
        if self.current is not None:
            self.profile[self.current][name] += seconds


def tap_trl_profiling(recorder: StepRecorder) -> bool:
    """Also send TRL's profiling durations to `recorder` (TRL only reports them to wandb/mlflow/trackio).

    Wraps a method of TRL's ProfilingContext in this process; returns False where TRL 1.16's layout differs,
    in which case the per-step `profile` stays empty and nothing else changes.
    """
    try:
        from trl.extras import profiling
    except ImportError:
        return False
    ctx = getattr(profiling, "ProfilingContext", None)
    original = getattr(ctx, "_log_metrics", None)
    if ctx is None or original is None:
        return False

    def _log_metrics(self: Any, duration: float) -> None:
        recorder.profiled(str(getattr(self, "name", "?")), float(duration))
        original(self, duration)

    ctx._log_metrics = _log_metrics
    return True


def build_steps(recorder: StepRecorder, per_step: int, budget: int) -> tuple[list[dict[str, Any]], set[str]]:
    out: list[dict[str, Any]] = []
    sources: set[str] = set()
    for step in sorted(recorder.steps):
        rec = recorder.steps[step]
        if "t_begin" not in rec or "t_end" not in rec:
            raise PeerError(f"step {step} has no begin/end timestamps (keys: {sorted(rec)})")
        logs = rec.get("logs", {})
        tokens, source = completion_tokens_of(logs, per_step, budget)
        sources.add(source)
        out.append({
            "step": step, "t_begin": rec["t_begin"], "t_end": rec["t_end"],
            "seconds": rec["t_end"] - rec["t_begin"],
            "wall_begin": rec["wall_begin"], "wall_end": rec["wall_end"],
            "completions": per_step, "completion_tokens": tokens,
            "logs": logs, "profile": dict(recorder.profile.get(step, {})),
        })
    return out, sources


# ---- the run ----

def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.models.io.loading import load_tokenizer
    from services.tasks.base import Prompt
    from services.tasks.synthetic import SyntheticTask

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PeerError("--device cuda but torch sees no CUDA device")
    if args.use_vllm and device != "cuda":
        raise PeerError("--use-vllm needs --device cuda")
    result.update(trl_version=trl.__version__, transformers_version=transformers.__version__,
                  torch_version=torch.__version__, datasets_version=datasets.__version__, device=device)
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)

    tokenizer = load_tokenizer(args.model)
    words = args.words if args.words is not None else len(tokenizer) - N_SPECIAL
    per_step = args.prompts_per_step * args.group
    grad_accum = per_step // args.micro_batch
    n_steps = args.warmup + args.steps
    result["config"].update(words=words, completions_per_step=per_step, gradient_accumulation_steps=grad_accum)

    task = SyntheticTask({"prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
                          "words": words})
    texts = [task.prompt(i).text for i in range(n_steps * args.prompts_per_step)]
    # Tokenized exactly as GRPOTrainer tokenizes plain-text prompts (`processing_class(text=...)`).
    ids = tokenizer(text=texts)["input_ids"]
    bad = [i for i, row in enumerate(ids) if len(row) != args.prompt_tokens]
    if bad:
        raise PeerError(f"{len(bad)} of {len(ids)} prompts do not tokenize to --prompt-tokens {args.prompt_tokens} "
                        f"tokens (first: prompt {bad[0]} -> {len(ids[bad[0]])}); is {args.model} a word-level "
                        "tokenizer over w<k> words?")
    if tokenizer.unk_token_id is not None and any(tokenizer.unk_token_id in row for row in ids):
        raise PeerError(f"prompts contain <unk>: --words {words} exceeds the tokenizer's word vocabulary")

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype)
    embeddings: Any = model.get_input_embeddings()
    vocab = int(embeddings.weight.shape[0])
    if vocab < len(tokenizer):
        raise PeerError(f"model embeds {vocab} ids but the tokenizer has {len(tokenizer)}")
    n_params = sum(p.numel() for p in model.parameters())
    result["model"] = {"path": str(args.model), "params": n_params, "vocab": vocab, "dtype": str(dtype),
                       "model_type": getattr(model.config, "model_type", None)}
    say(f"model {args.model.name}: {n_params / 1e6:.1f}M params, vocab {vocab}, {dtype}, device {device}")

    def synthetic_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        # Same call rlfleet's reward service makes; the synthetic reward reads only the prompt text.
        return [task.reward(Prompt(index=0, text=p, answer=""), c) for p, c in zip(prompts, completions, strict=True)]

    dataset = datasets.Dataset.from_dict({"prompt": texts})

    # min_new_tokens (transformers) / min_tokens (vLLM) suppress every EOS id until the budget is reached,
    # so each completion is exactly --completion-tokens long, as in rlfleet's fixed-budget benchmark.
    gen_kwargs = ({"min_tokens": args.completion_tokens} if args.use_vllm
                  else {"min_new_tokens": args.completion_tokens})
    workdir = Path(tempfile.mkdtemp(prefix="trl-peer-"))
    cfg_kwargs: dict[str, Any] = dict(
        output_dir=str(workdir),
        num_generations=args.group,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=grad_accum,
        max_completion_length=args.completion_tokens,
        generation_kwargs=gen_kwargs,
        temperature=args.temperature,
        learning_rate=args.lr,
        beta=args.kl_coef,
        num_iterations=1,
        max_steps=n_steps,
        shuffle_dataset=False,
        seed=args.seed,
        data_seed=args.seed,
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        log_completions=False,
        disable_tqdm=True,
        use_vllm=args.use_vllm,
    )
    if args.use_vllm:
        cfg_kwargs.update(vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                          vllm_max_model_length=args.prompt_tokens + args.completion_tokens)
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = sorted(set(cfg_kwargs) - known)
    if missing:
        raise PeerError(f"GRPOConfig of TRL {trl.__version__} has no field(s) {missing}")
    cfg = GRPOConfig(**cfg_kwargs)
    # TRL derives the generation batch from the train batch; check that it is one round per optimizer step.
    if cfg.generation_batch_size != per_step or cfg.steps_per_generation != grad_accum:
        raise PeerError(f"TRL resolved generation_batch_size={cfg.generation_batch_size}, "
                        f"steps_per_generation={cfg.steps_per_generation}; expected {per_step}, {grad_accum}")
    result["grpo_config"] = {k: getattr(cfg, k) for k in sorted(cfg_kwargs)} | {
        k: getattr(cfg, k, None) for k in ("generation_batch_size", "steps_per_generation", "loss_type",
                                           "scale_rewards", "epsilon", "top_p", "top_k", "max_grad_norm",
                                           "lr_scheduler_type", "mask_truncated_completions")}

    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    recorder = StepRecorder(sync)
    result["profile_tapped"] = tap_trl_profiling(recorder)

    class Timing(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            recorder.begin(state.global_step + 1)  # global_step counts completed steps

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            recorder.end(state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kw: Any) -> None:
            if logs:
                recorder.log(state.global_step, logs)

    trainer = GRPOTrainer(model=model, reward_funcs=synthetic_reward, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timing()])
    result["setup_s"] = time.perf_counter() - t0
    say(f"training {n_steps} steps ({args.warmup} warm-up) of {args.prompts_per_step} prompts x {args.group} "
        f"= {per_step} completions, micro-batch {args.micro_batch} x {grad_accum}")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_train = time.perf_counter()
    try:
        trainer.train()
    except BaseException:
        # No second chance on the GPU host: keep what the steps that did finish measured.
        result["partial_steps"] = [recorder.steps[k] for k in sorted(recorder.steps)]
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # save_strategy="no": nothing in it is needed
    result["train_s"] = time.perf_counter() - t_train
    if device == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30

    steps, sources = build_steps(recorder, per_step, args.completion_tokens)
    result["steps"] = steps
    result["train_summary"] = recorder.train_summary
    result["completion_tokens_source"] = sources.pop() if len(sources) == 1 else sorted(sources)
    if len(steps) != n_steps:
        raise PeerError(f"recorded {len(steps)} optimizer steps, expected {n_steps}")
    lengths = [(s["logs"].get("completions/min_length"), s["logs"].get("completions/max_length")) for s in steps]
    exact = all(lo == hi == args.completion_tokens for lo, hi in lengths)
    result["exact_length_completions"] = exact
    if not exact:
        say(f"warning: completion lengths (min, max) per step {lengths} are not all {args.completion_tokens}")
    result["steady"] = steady_state(steps, args.warmup)


def _terminated(signum: int, _frame: Any) -> None:
    # An orchestrator's timeout sends SIGTERM: fail through the normal path so the JSON (with the steps
    # measured so far) is still written.
    raise PeerError(f"terminated by signal {signal.Signals(signum).name}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    result: dict[str, Any] = {"framework": "trl", "ok": False, "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}}
    t0 = time.time()
    try:
        run(args, result)
        result["ok"] = True
    except (Exception, KeyboardInterrupt) as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    result["wall_s"] = time.time() - t0
    try:
        write_json(args.out, result)
    except OSError as err:
        say(f"cannot write {args.out}: {err}")
        return 1
    if not result["ok"]:
        print(result["traceback"], file=sys.stderr)
        say(f"FAILED: {result['error']} (details in {args.out})")
        return 1
    st = result["steady"]
    summary = {"framework": "trl", "ok": True, "out": str(args.out), "device": result["device"],
               "steps_measured": st["steps_measured"], "median_step_s": st["median_step_s"],
               "samples_per_s": st["samples_per_s"], "tokens_per_s": st["tokens_per_s"],
               "completion_tokens_source": result["completion_tokens_source"],
               "exact_length_completions": result["exact_length_completions"]}
    print(json.dumps(json_safe(summary)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
