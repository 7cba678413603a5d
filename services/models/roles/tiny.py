"""Tiny task models: a transformers config, a seeded random init and a short supervised warm-up.

The warm-up trains on `task.sft_example(i)` (prompt tokens masked out of the loss, EOS appended to the
completion) just long enough that RL starts from a policy that is right sometimes but not always.
The whole build runs on CPU, in a few seconds, and is written atomically (see `atomic.staging_dir`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.core.config.run import TinyModelSpec
from services.models.engine import SamplingParams
from services.models.engines.hf_engine import TransformersEngine
from services.models.io.atomic import MARKER, is_complete, staging_dir
from services.models.nets.logprobs import position_ids_from_mask
from services.models.roles.tokenizer import build_tokenizer, decode_completion
from services.tasks import chat
from services.tasks.base import Task

log = logging.getLogger(__name__)

WARMUP_BATCH = 64
EVAL_PROMPTS = 128
MAX_POSITIONS = 2048


def tiny_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase, **extra: Any) -> Qwen2Config | LlamaConfig:
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    if spec.arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny model arch {spec.arch!r}; allowed: 'qwen2', 'llama'")


def _causal_lm(config: Qwen2Config | LlamaConfig) -> PreTrainedModel:
    model: PreTrainedModel = Qwen2ForCausalLM(config) if isinstance(config, Qwen2Config) else LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model


def _sft_batches(task: Task, tokenizer: PreTrainedTokenizerBase, steps: int, batch: int) -> list[
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]:
    """Right-padded (input_ids, attention_mask, labels) per step; labels are -100 off the completion."""
    pad, eos = int(tokenizer.pad_token_id), int(tokenizer.eos_token_id)
    examples = [task.sft_example(i) for i in range(steps * batch)]
    # One batched call each (encode_prompt/encode_completion semantics, without per-example overhead).
    p_all = tokenizer([p for p, _ in examples], add_special_tokens=False)["input_ids"]
    c_all = tokenizer([c for _, c in examples], add_special_tokens=False)["input_ids"]
    out = []
    for s in range(steps):
        sl = slice(s * batch, (s + 1) * batch)
        rows = [list(p) + list(c) + [eos] for p, c in zip(p_all[sl], c_all[sl], strict=True)]
        n_prompt = [len(p) for p in p_all[sl]]
        width = max(len(r) for r in rows)
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for i, (r, k) in enumerate(zip(rows, n_prompt, strict=True)):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
            labels[i, k : len(r)] = ids[i, k : len(r)]
        out.append((ids, mask, labels))
    return out


def warmup(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, spec: TinyModelSpec) -> float:
    """Supervised warm-up; returns the mean loss over the last tenth of the steps (nan with 0 steps)."""
    if spec.warmup_steps == 0:
        return float("nan")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr, weight_decay=0.0)
    # Cosine decay to a tenth of the peak: the end state is less at the mercy of the last few steps.
    n = spec.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * s / n)))
    losses: list[float] = []
    for ids, mask, labels in _sft_batches(task, tokenizer, n, WARMUP_BATCH):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    n: int = EVAL_PROMPTS,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean task reward on the first `n` eval prompts (exact-match accuracy on arithmetic)."""
    engine = TransformersEngine(model, [int(tokenizer.eos_token_id)], int(tokenizer.pad_token_id))
    prompts = [task.eval_prompt(i) for i in range(n)]
    params = SamplingParams(temperature=temperature, max_new_tokens=task.max_new_tokens, seed=seed)
    completions = engine.generate([chat.encode_prompt(task, tokenizer, p) for p in prompts], params)
    rewards = [task.reward(p, decode_completion(tokenizer, c.token_ids)) for p, c in zip(prompts, completions,
                                                                                           strict=True)]
    return sum(rewards) / max(len(rewards), 1)


def build_tiny_model(task: Task, spec: TinyModelSpec, out_dir: Path, seed: int) -> Path:
    """Build, warm up and save a tiny causal LM + tokenizer for `task` at `out_dir`; returns `out_dir`.

    An existing complete directory is kept as is (first builder wins). Writes `rlfleet_model.json`
    with the task, spec, seed and the warm-up's eval reward (exact-match accuracy on arithmetic).
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        log.info("tiny model already built at %s", out_dir)
        return out_dir
    t0 = time.monotonic()
    tokenizer = build_tokenizer(task)
    # Tiny matrices gain nothing from intra-op threads, and on a busy host two threads contending
    # for two cores run up to 3x slower than one; the build is single-threaded, then restored.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _causal_lm(tiny_config(spec, tokenizer))
            loss = warmup(model, tokenizer, task, spec)
        with torch.no_grad():
            reward_t1 = evaluate(model, tokenizer, task, temperature=1.0, seed=seed)
            reward_greedy = evaluate(model, tokenizer, task, temperature=0.0, seed=seed)
    finally:
        torch.set_num_threads(threads)
    seconds = time.monotonic() - t0
    info = {
        "kind": "causal_lm",
        "task": task.name,
        "task_params": dict(task.params),
        "spec": spec.model_dump(),
        "seed": seed,
        "warmup": {
            "final_loss": loss,
            "eval_prompts": EVAL_PROMPTS,
            "eval_reward_t1": reward_t1,
            "eval_reward_greedy": reward_greedy,
        },
        "build_seconds": round(seconds, 3),
    }
    with staging_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
    log.info("built tiny %s model for %s at %s in %.1fs: warm-up loss %.3f, eval reward %.3f (T=1) %.3f (greedy)",
             spec.arch, task.name, out_dir, seconds, loss, reward_t1, reward_greedy)
    return out_dir
