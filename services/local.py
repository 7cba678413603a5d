"""The single-process reference loop: the same config, RL core and engine as the fleet, with no
services in between. It is the baseline the fleet must reproduce (`rlfleet train --local`)."""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from services.core.config.run import RunConfig
from services.core.ids import generation_seed, task_id
from services.core.observability.trackers import Trackers
from services.models.checkpoints.checkpoint import prune, save_checkpoint
from services.models.checkpoints.export import export_final, record_local_config
from services.models.engine import GenerationEngine, SamplingParams, completions_to_rollout
from services.models.engines.factory import make_engine
from services.models.io.loading import load_causal_lm
from services.models.nets.lora import check_only_adapters_train, engine_weights, load_policy
from services.models.roles.resolve import critic_path, prepare
from services.reference.scorer import ReferenceScorer
from services.reward.scorer import RewardScorer, reward_model_path
from services.rl import batch as rb
from services.rl.dynamic_sampling import fill_step
from services.rl.pipeline import compute_advantages
from services.rl.trainer import PolicyTrainer, ValueTrainer
from services.tasks import chat
from services.tasks import evaluation as ev
from services.tasks.base import Task

log = logging.getLogger("rlfleet.local")


def sampling_params(cfg: RunConfig, tokenizer, seed: int) -> SamplingParams:  # type: ignore[no-untyped-def]
    g = cfg.generation
    stops = tuple(sorted({tokenizer.eos_token_id, *g.stop_token_ids}))
    return SamplingParams(
        temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
        stop_token_ids=stops, seed=seed, logprobs=g.behaviour_logprobs == "engine",
    )


def encode_prompts(task: Task, tokenizer, indices: list[int]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return chat.encode_prompts(task, tokenizer, indices)


def generate_message(
    cfg: RunConfig, engine: GenerationEngine, task: Task, tokenizer, first_index: int  # type: ignore[no-untyped-def]
) -> rb.Rollout:
    """Generate one prompt message's worth of samples, exactly as the actor does for a PromptBatch."""
    indices = list(range(first_index, first_index + cfg.batch.prompts_per_message))
    prompts = encode_prompts(task, tokenizer, indices)
    g = cfg.algo.group_size
    flat = [p for p in prompts for _ in range(g)]
    tids = [task_id(i, k) for i in indices for k in range(g)]
    groups = [i for i in indices for _ in range(g)]
    params = sampling_params(cfg, tokenizer, generation_seed(cfg.run.seed, first_index))
    comps = engine.generate(flat, params)
    return completions_to_rollout(tids, flat, comps, groups, engine.version, tokenizer.pad_token_id)


def evaluate(cfg: RunConfig, engine: GenerationEngine, task: Task, tokenizer, step: int,  # type: ignore[no-untyped-def]
             version: int, samples_path: Path, suffix: str = "") -> dict[str, float]:
    """Held-out evaluation, greedy and sampled at the training temperature, exactly as the fleet's
    controller runs it through the actor: its metrics keys; its completions go to samples.jsonl."""
    n = ev.eval_size(task, cfg.task.eval_size)
    if n == 0:
        return {}
    prompts = ev.eval_prompts(task, n)
    ids = ev.encode_eval_prompts(task, tokenizer, prompts)
    sampled = sampling_params(cfg, tokenizer, seed=ev.eval_seed(cfg.run.seed))
    params = {"greedy": replace(sampled, temperature=0.0), "sampled": sampled}
    reward_model = cfg.models.reward is not None
    results = {}
    for mode in ev.MODES:
        comps = engine.generate(ids, params[mode])
        texts = tokenizer.batch_decode([c.token_ids for c in comps], skip_special_tokens=True)
        results[mode] = ev.evaluate_mode(task, mode, prompts, texts, reward_model=reward_model)
    with samples_path.open("a") as f:
        f.writelines(ev.sample_lines(step, version, prompts, results))
    return ev.metrics_of(results, suffix)


def run_local(
    cfg: RunConfig, on_step: Callable[[dict[str, float]], None] | None = None
) -> Path:
    torch.manual_seed(cfg.run.seed)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    roles = prepare(cfg)
    task, tok = roles.task, roles.tokenizer
    dtype = cfg.models.policy.dtype
    policy = load_policy(cfg.models.policy, roles.policy_path, cfg.endpoint("actor").device, cfg.run.seed)
    engine = make_engine(cfg.generation.engine, roles.policy_path, dtype=cfg.generation.engine_dtype(dtype),
                         **cfg.generation.engine_kwargs(cfg.run_dir))
    reward = RewardScorer(task, tok, model_path=reward_model_path(cfg))
    reference = (
        ReferenceScorer(load_causal_lm(roles.policy_path, dtype=dtype, device=cfg.endpoint("reference").device),
                        cfg.generation.temperature, micro_batch=cfg.algo.micro_batch_size,
                        micro_tokens=cfg.algo.micro_batch_tokens, pack=cfg.algo.pack_sequences,
                        chunk_tokens=cfg.algo.logprob_chunk_tokens, compile=cfg.algo.compile,
                        tf32=cfg.algo.tf32)
        if cfg.algo.needs_reference else None
    )
    trainer = PolicyTrainer(policy, cfg.algo, cfg.generation.temperature, seed=cfg.run.seed,
                            gradient_checkpointing=cfg.models.policy.gradient_checkpointing,
                            behaviour_logprobs=cfg.generation.behaviour_logprobs,
                            max_staleness=cfg.flow.max_staleness)
    if cfg.models.policy.lora is not None:
        check_only_adapters_train(policy, trainer.opt)
    critic = critic_trainer = None
    if cfg.algo.needs_critic:
        from services.models.nets.critic import ValueModel

        spec = cfg.models.critic or cfg.models.policy
        critic = ValueModel.from_policy(critic_path(cfg, roles.policy_path), dtype=spec.dtype,
                                        device=cfg.endpoint("critic").device)
        critic_trainer = ValueTrainer(critic, cfg.algo, seed=cfg.run.seed,
                                      gradient_checkpointing=spec.gradient_checkpointing)

    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    samples_path = run_dir / ev.SAMPLES_FILE
    samples_path.unlink(missing_ok=True)
    if cfg.models.reward is not None and cfg.task.eval_size:
        log.info("eval reward unavailable: the run's reward is a reward model (models.reward); samples only")
    # A local run starts afresh, so a previous local run's checkpoints would only collide with its versions.
    shutil.rmtree(cfg.checkpoint_dir / "actor", ignore_errors=True)
    record_local_config(cfg, roles.policy_path)
    # A local run starts afresh, so it is a new tracker run too (a new id), not a continuation.
    trackers = Trackers(cfg, run_id=uuid.uuid4().hex)
    trackers.start(first_step=1)
    version = 0
    eval_before = evaluate(cfg, engine, task, tok, 0, version, samples_path, suffix="_before")
    log.info("eval before training", extra=eval_before)
    per_msg, algo = cfg.batch.prompts_per_message, cfg.algo
    cursor = 0  # dataset index of the next message

    def score(part: rb.Rollout) -> dict[str, torch.Tensor]:
        """Score one message, as the scoring services do; its reward components by name."""
        part.rewards, named = reward.score_with_components(part)
        if reference is not None:
            part.ref_logprobs = reference.score(part)
        if critic_trainer is not None:
            part.values = critic_trainer.score(part)
        return named

    for step in range(cfg.run.max_steps):
        t0 = time.perf_counter()
        ds_stats: dict[str, float] = {}
        components: dict[str, list[float]] = {}
        if algo.dynamic_sampling:
            # Generation and scoring interleave: each message is judged before the next is sampled.
            filled = fill_step(step + 1, cursor, cfg.batch.prompts_per_step, per_msg, algo.dynamic_sampling_tol,
                               algo.dynamic_sampling_max_rounds,
                               lambda first: _sampled(generate_message(cfg, engine, task, tok, first), score))
            parts, components, cursor, ds_stats = filled.groups, filled.components, filled.cursor, filled.stats()
            t_gen = time.perf_counter()
        else:
            parts = [generate_message(cfg, engine, task, tok, cursor + k * per_msg)
                     for k in range(cfg.batch.prompts_per_step // per_msg)]
            cursor += cfg.batch.prompts_per_step
            t_gen = time.perf_counter()
            for part in parts:
                for name, values in score(part).items():
                    components.setdefault(name, []).extend(values.tolist())
        # ... then join into the step batch.
        r = rb.concat(parts, pad_id=tok.pad_token_id)  # type: ignore[attr-defined]
        t_score = time.perf_counter()
        stats = compute_advantages(r, cfg.algo, cfg.generation.max_new_tokens, cfg.generation.behaviour_logprobs)
        stats.update(ds_stats)
        stats.update(trainer.train_step(r, step=step, current_version=version))
        if critic_trainer is not None:
            stats.update(critic_trainer.train_step(r, step=step))
        version += 1
        engine.update_weights(engine_weights(policy), version)
        if step + 1 == cfg.run.max_steps or version % cfg.checkpoint.every == 0:
            save_checkpoint(cfg.checkpoint_dir, "actor", version, step + 1, policy, trainer.opt)
            prune(cfg.checkpoint_dir, "actor", keep=cfg.checkpoint.keep)
        t_end = time.perf_counter()
        tokens = int(r.response_mask.sum())
        row = {
            "step": step + 1, "time": time.time(), "version": version, **stats,
            "tokens": tokens, "samples": len(r),
            "tokens_per_s": tokens / (t_end - t0), "samples_per_s": len(r) / (t_end - t0),
            "generate_s": t_gen - t0, "score_s": t_score - t_gen, "train_s": t_end - t_score,
            "step_s": t_end - t0,
        }
        if len(components) > 1:  # as the controller records them
            row.update({f"reward/{n}": sum(v) / len(v) for n, v in sorted(components.items())})
        last = step + 1 == cfg.run.max_steps
        if last or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0):
            row.update(evaluate(cfg, engine, task, tok, step + 1, version, samples_path))
        if step == 0:
            row.update(eval_before)
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        trackers.log_row(row)
        if on_step is not None:
            on_step(row)
    trackers.finish()
    export_final(run_dir, base=roles.policy_path)
    return metrics_path



def _sampled(part: rb.Rollout, score: Callable[[rb.Rollout], dict[str, torch.Tensor]]) -> tuple[
        rb.Rollout, dict[str, torch.Tensor]]:
    return part, score(part)
