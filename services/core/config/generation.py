"""The generation section of the run configuration: the actor's engine, how it samples, and how the
trainer's weights reach it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from services.core.config.base import Strict
from services.core.config.vllm import VLLMOptions

BehaviourLogprobs = Literal["engine", "trainer"]


class GenerationSection(Strict):
    engine: Literal["transformers", "vllm"] = "transformers"
    # Device of the generation engine ("cuda" for vLLM; the GPU is chosen by CUDA_VISIBLE_DEVICES).
    device: str = "cpu"
    # The engine's weights dtype; unset means the policy's (models.policy.dtype). A float32 trainer with
    # a bfloat16 engine keeps fp32 master weights (small updates survive) while generating at bf16 speed;
    # each weight sync casts.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    max_new_tokens: Annotated[int, Field(ge=1, le=32768)] = 8
    temperature: Annotated[float, Field(gt=0, le=10)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    behaviour_logprobs: BehaviourLogprobs = "engine"
    """Who scores the sampled tokens for PPO's ratio. "engine": the engine reports each one's log-prob
    under the sampling policy (behaviour): every batch clips against the trainer's proximal log-probs
    and is weighted by proximal/behaviour (algo.decoupled, algo.behaviour_correction).
    "trainer": the engine computes none (vLLM's log-prob output costs ~40% of its decode throughput);
    the trainer's proximal log-probs (a no-grad pass before the updates, or each forward's own when
    the batch takes one optimizer step) are every batch's old policy, on-policy too; it clips against
    them and weights nothing (TRL without its vLLM importance-sampling correction): the engine/trainer
    numeric mismatch and a stale batch's policy lag go uncorrected. Excludes algo.kl_in "reward" (behaviour vs
    reference); the rollout's "kl" metric is then absent (KL-in-loss still reports kl_loss)."""
    # Extra stop tokens beyond the tokenizer's EOS.
    stop_token_ids: list[int] = Field(default_factory=list)
    # Sequences per forward pass in the engine; 0 means the whole prompt batch at once.
    micro_batch: Annotated[int, Field(ge=0)] = 0
    batch_messages: Annotated[int, Field(ge=1, le=1024)] = 8
    """The most prompt messages the actor generates in one engine call. It reads up to this many
    waiting messages at once and generates those that wait together as one batch, each row seeded as
    its own message's (the completions do not depend on the grouping), then publishes one rollout per
    message. 1 makes one engine call per message: a step of many small messages then decodes its
    tokens once per message, which paced the step once the trainer was fast (BENCHMARKS.md,
    2026-12-07 late night: four calls of 64 rows took 1.39x one call of 256)."""
    # Run the engine in a child process of the actor: generation then overlaps the policy update
    # without sharing the actor's GIL (weights still move without copies: shared memory or CUDA IPC).
    process: bool = False
    # Data-parallel engine replicas of the actor, each in its own process (services/models/engines/replicas.py):
    # the prompts of a message are spread over them and joined in order, with the same per-row seeds.
    # On a device group of replicas x tensor_parallel_size GPUs each replica gets its own; with fewer
    # GPUs (tensor_parallel_size 1) replicas share them and split vllm.gpu_memory_utilization.
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    # vLLM's tensor parallelism: GPUs per engine replica (engine vllm only).
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    # How a weight sync reaches an engine in its own process: "ipc" passes the trainer's tensors by
    # reference (shared memory, CUDA IPC: the engine must see the trainer's GPU); "collective"
    # broadcasts them bucket by bucket over a torch.distributed group of the two (NCCL between GPUs,
    # gloo on the CPU); "auto" is ipc where the engine shares the trainer's GPU or the CPU, else
    # collective (replicas pinned to GPUs of their own).
    weight_transfer: Literal["auto", "ipc", "collective"] = "auto"
    # The collective's backend: "auto" is NCCL for CUDA engines and gloo on the CPU; "gloo" on CUDA
    # stages each bucket through host memory (slower, but needs no NCCL path between the two
    # processes, and works for two processes on one GPU, which NCCL refuses).
    weight_transfer_backend: Literal["auto", "nccl", "gloo"] = "auto"
    # Bytes per broadcast of a collective weight sync, in MiB: two buckets are in flight at a time (one
    # staged or loaded while the other is on the wire), so a bucket well under the model pipelines.
    weight_transfer_bucket_mb: Annotated[int, Field(ge=1, le=16384)] = 64
    # Bound on joining the transfer group and on each broadcast: a dead peer fails the sync by then.
    weight_transfer_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0

    @model_validator(mode="after")
    def _parallel_engine(self) -> GenerationSection:
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs engine 'vllm'"
                             f" (engine '{self.engine}' runs on one device)")
        if self.weight_transfer == "collective" and not (self.process or self.replicas > 1):
            raise ValueError("weight_transfer 'collective' needs an engine in its own process:"
                             " set generation.process or generation.replicas > 1")
        if self.weight_transfer_backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"weight_transfer_backend 'nccl' needs a CUDA engine (generation.device is"
                             f" {self.device!r}): use 'auto' or 'gloo'")
        return self

    def engine_dtype(self, policy_dtype: str) -> str:
        return self.dtype or policy_dtype

    def starts_beside_trainer(self, env: Mapping[str, str]) -> bool:
        """Whether the actor may build its trainer while its engines start: not while vLLM profiles
        the GPU's free memory (`vllm.kv_cache_gib`, or RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES in `env`,
        skips that), and only for engines in processes of their own (`process`, or replicas, which
        always are; an engine in the actor's process would share its thread)."""
        profiles = self.engine == "vllm" and self.vllm.kv_cache_gib is None and \
            not env.get("RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES")
        return (self.process or self.replicas > 1) and not profiles

    def engine_kwargs(self, run_dir: Path | None = None) -> dict[str, Any]:
        """Keyword arguments for `services.models.engines.factory.make_engine`; `run_dir` anchors relative paths."""
        kw: dict[str, Any] = {"device": self.device, "micro_batch": self.micro_batch, "process": self.process,
                              "replicas": self.replicas, "tensor_parallel_size": self.tensor_parallel_size}
        if self.process or self.replicas > 1:
            kw.update(weight_transfer=self.weight_transfer, weight_transfer_backend=self.weight_transfer_backend,
                      weight_transfer_bucket_mb=self.weight_transfer_bucket_mb,
                      weight_transfer_timeout_s=self.weight_transfer_timeout_s)
        if self.engine == "vllm":
            kw.update(self.vllm.engine_options(run_dir))
        return kw
