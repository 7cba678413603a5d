"""The run configuration: one YAML file, validated once at start-up.

Every service, the CLI and the local loop read the same `RunConfig`. Unknown keys are errors
(`extra="forbid"`) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ServiceName = Literal["controller", "actor", "critic", "reward", "reference"]
SERVICE_NAMES: tuple[ServiceName, ...] = ("controller", "actor", "critic", "reward", "reference")
SCORING_STAGES: tuple[ServiceName, ...] = ("reference", "reward", "critic")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "tiny"
    dir: str = "runs/tiny"
    seed: int = 0
    max_steps: Annotated[int, Field(ge=1)] = 30
    # Evaluate mean reward on held-out prompts every N steps (0 = only before and after).
    eval_every: Annotated[int, Field(ge=0)] = 0


class TaskSection(_Strict):
    name: Literal["arithmetic", "sentiment", "synthetic"] = "arithmetic"
    # Task-specific knobs, validated by the task itself (see services.tasks).
    params: dict[str, Any] = Field(default_factory=dict)
    # A `module:function` reward overriding the task's own rule-based reward.
    reward_fn: str | None = None
    eval_size: Annotated[int, Field(ge=0)] = 64

    @field_validator("reward_fn")
    @classmethod
    def _module_colon_function(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"must look like 'package.module:function', got {v!r}")
        return v


class TinyModelSpec(_Strict):
    """A small model built from a transformers config, with a short supervised warm-up on the task
    so that RL starts from a learnable (not all-zero reward) policy."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: Annotated[int, Field(ge=8)] = 64
    num_layers: Annotated[int, Field(ge=1)] = 2
    num_heads: Annotated[int, Field(ge=1)] = 4
    num_kv_heads: Annotated[int, Field(ge=1)] = 2
    intermediate_size: Annotated[int, Field(ge=8)] = 128
    warmup_steps: Annotated[int, Field(ge=0)] = 250
    warmup_lr: Annotated[float, Field(gt=0)] = 3e-3

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        return self


class ModelSpec(_Strict):
    # A local directory holding a transformers model and its tokenizer. Never a hub id.
    path: str | None = None
    # Build a tiny model into `path` (or the run directory) when it does not exist yet.
    build: TinyModelSpec | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _path_or_build(self) -> ModelSpec:
        if self.path is None and self.build is None:
            raise ValueError("set 'path' (a local model directory) or 'build' (a tiny model spec)")
        return self


class ModelsSection(_Strict):
    policy: ModelSpec = Field(default_factory=lambda: ModelSpec(build=TinyModelSpec()))
    # None: the critic is the initial policy backbone plus a fresh scalar value head.
    critic: ModelSpec | None = None
    # None: the task's rule-based reward. A path: a sequence classifier with one label.
    reward: ModelSpec | None = None


class AlgoSection(_Strict):
    name: Literal["ppo", "grpo", "rloo", "reinforce_pp"] = "grpo"
    group_size: Annotated[int, Field(ge=1)] = 8
    kl_coef: Annotated[float, Field(ge=0)] = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["reward", "loss"] = "loss"
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[float, Field(gt=0, lt=10)] | None = None
    value_clip: Annotated[float, Field(gt=0)] = 0.2
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    entropy_coef: Annotated[float, Field(ge=0)] = 0.0
    ppo_epochs: Annotated[int, Field(ge=1)] = 1
    minibatch_size: Annotated[int, Field(ge=1)] = 32
    # Sequences per forward pass of the trainers (gradients accumulate over them, one optimizer step
    # per minibatch) and of the reference and critic scorers; 0 means a whole minibatch or message
    # at once. Bounds the [micro, tokens, vocab] log-prob tensors on large vocabularies.
    micro_batch_size: Annotated[int, Field(ge=0)] = 0
    lr: Annotated[float, Field(gt=0)] = 1e-4
    critic_lr: Annotated[float, Field(gt=0)] = 1e-3
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    # Decoupled PPO: clip against the proximal (current pre-update) policy and weight by
    # exp(proximal - behaviour), which keeps off-policy batches (max_staleness > 0) stable.
    decoupled: bool = True
    behaviour_weight_cap: Annotated[float, Field(gt=1)] = 5.0

    @model_validator(mode="after")
    def _groups(self) -> AlgoSection:
        if self.name in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (got {self.group_size})")
        return self

    @property
    def needs_critic(self) -> bool:
        return self.name == "ppo"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0


class VLLMOptions(_Strict):
    # The engine shares its GPU with the trainer when colocated: leave room for it.
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.35
    enforce_eager: bool = False
    max_model_len: Annotated[int, Field(ge=16)] | None = None

    def engine_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu_memory_utilization": self.gpu_memory_utilization,
                               "enforce_eager": self.enforce_eager}
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        return out


class GenerationSection(_Strict):
    engine: Literal["transformers", "vllm"] = "transformers"
    # Device of the generation engine ("cuda" for vLLM; the GPU is chosen by CUDA_VISIBLE_DEVICES).
    device: str = "cpu"
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    max_new_tokens: Annotated[int, Field(ge=1, le=32768)] = 8
    temperature: Annotated[float, Field(gt=0, le=10)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    # Extra stop tokens beyond the tokenizer's EOS.
    stop_token_ids: list[int] = Field(default_factory=list)
    # Sequences per forward pass in the engine; 0 means the whole prompt batch at once.
    micro_batch: Annotated[int, Field(ge=0)] = 0
    # Run the engine in a child process of the actor: generation then overlaps the policy update
    # without sharing the actor's GIL (weights still move without copies: shared memory or CUDA IPC).
    process: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `services.models.engine.make_engine`."""
        kw: dict[str, Any] = {"device": self.device, "micro_batch": self.micro_batch, "process": self.process}
        if self.engine == "vllm":
            kw.update(self.vllm.engine_options())
        return kw


class BatchSection(_Strict):
    # Prompts admitted per training step; each is sampled `algo.group_size` times.
    prompts_per_step: Annotated[int, Field(ge=1)] = 16
    # Prompts per message on the prompts stream.
    prompts_per_message: Annotated[int, Field(ge=1)] = 4


class DeviceGroup(_Strict):
    ids: list[Annotated[int, Field(ge=0)]] | None = None
    count: Annotated[int, Field(ge=1)] | None = None
    min_memory_gb: Annotated[float, Field(ge=0)] = 0
    arch: str | None = None
    prefer_arch: str | None = None

    @model_validator(mode="after")
    def _ids_or_count(self) -> DeviceGroup:
        if (self.ids is None) == (self.count is None):
            raise ValueError("a device group sets exactly one of 'ids' or 'count'")
        if self.ids is not None and len(set(self.ids)) != len(self.ids):
            raise ValueError(f"device ids repeat: {self.ids}")
        return self


class Endpoint(_Strict):
    host: str = "127.0.0.1"
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = 0
    http_port: Annotated[int, Field(ge=0, le=65535)] = 0
    device_group: str | None = None
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    # Torch device of this service's models (trainer, scorer): "cpu", "cuda" or "cuda:N". The GPU
    # behind "cuda" is the first of the device group's, which sets CUDA_VISIBLE_DEVICES.
    device: str = "cpu"

    @field_validator("device")
    @classmethod
    def _torch_device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v


def _default_services() -> dict[ServiceName, Endpoint]:
    base: dict[ServiceName, int] = {"controller": 0, "actor": 1, "critic": 2, "reward": 3, "reference": 4}
    return {n: Endpoint(grpc_port=50050 + i, http_port=8080 + i) for n, i in base.items()}


class RedisSection(_Strict):
    # None: `rlfleet up` starts a private redis-server (AOF on) in the run directory.
    url: str | None = None
    # Name of the environment variable holding the password; the password itself never sits in a file.
    password_env: str | None = None


class FlowSection(_Strict):
    max_staleness: Annotated[int, Field(ge=0)] = 0
    high_watermark: Annotated[float, Field(gt=0, le=1)] = 0.7
    low_watermark: Annotated[float, Field(ge=0, lt=1)] = 0.3
    # Rollout messages a scoring group may hold (lag + pending) before the fill ratio reaches 1.
    stream_capacity: Annotated[int, Field(ge=1)] = 256
    reclaim_idle_ms: Annotated[int, Field(ge=100)] = 30_000
    max_deliveries: Annotated[int, Field(ge=1)] = 3
    max_message_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    rpc_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # A prompt batch with no progress for this long is published again (its prompts, or its rollout
    # for the stages still missing): covers messages lost with a Redis that restarted empty or lost
    # its last second of AOF. Duplicates are harmless: results are put-if-absent.
    resend_after_s: Annotated[float, Field(gt=0)] = 60.0

    @model_validator(mode="after")
    def _watermarks(self) -> FlowSection:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        return self


class CheckpointSection(_Strict):
    # None: RUN_DIR/checkpoints.
    dir: str | None = None
    # Trainable services checkpoint every N of their own versions, and always when drained.
    every: Annotated[int, Field(ge=1)] = 10
    keep: Annotated[int, Field(ge=1)] = 2


class JournalSection(_Strict):
    # None: RUN_DIR/journal.
    dir: str | None = None
    map_size_bytes: Annotated[int, Field(ge=64 * 1024)] = 64 * 1024 * 1024
    max_map_size_bytes: Annotated[int, Field(ge=64 * 1024)] = 64 * 1024**3
    # Below this much free disk the controller stops admitting and reports not ready, before
    # LMDB itself would hit ENOSPC.
    min_free_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024


class SecuritySection(_Strict):
    # Name of the environment variable holding the shared token for gRPC metadata and admin routes.
    token_env: str | None = None


class RunConfig(_Strict):
    run: RunSection = Field(default_factory=RunSection)
    task: TaskSection = Field(default_factory=TaskSection)
    models: ModelsSection = Field(default_factory=ModelsSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    batch: BatchSection = Field(default_factory=BatchSection)
    devices: dict[str, DeviceGroup] = Field(default_factory=dict)
    services: dict[ServiceName, Endpoint] = Field(default_factory=_default_services)
    redis: RedisSection = Field(default_factory=RedisSection)
    flow: FlowSection = Field(default_factory=FlowSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    journal: JournalSection = Field(default_factory=JournalSection)
    security: SecuritySection = Field(default_factory=SecuritySection)

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        for name, ep in self.services.items():
            if ep.device_group is not None and ep.device_group not in self.devices:
                known = ", ".join(sorted(self.devices)) or "none defined"
                raise ValueError(
                    f"services.{name}.device_group: device group '{ep.device_group}' not found in devices"
                    f" (known: {known})"
                )
        for name, ep in self.services.items():
            if ep.replicas > 1 and name not in ("reward", "reference"):
                raise ValueError(
                    f"services.{name}.replicas: only the stateless scorers (reward, reference) run as several"
                    f" replicas, got {ep.replicas}"
                )
        if self.batch.prompts_per_step % self.batch.prompts_per_message:
            raise ValueError(
                f"batch.prompts_per_step ({self.batch.prompts_per_step}) must be a multiple of"
                f" batch.prompts_per_message ({self.batch.prompts_per_message})"
            )
        return self

    # -- derived -------------------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        return self.batch.prompts_per_step * self.algo.group_size

    @property
    def admission_window(self) -> int:
        """The most tasks in flight (admitted, not yet trained or dead): the staleness budget. With
        `flow.max_staleness` n, generation may run up to n steps ahead of training."""
        return (self.flow.max_staleness + 1) * self.samples_per_step

    def stages(self) -> list[ServiceName]:
        """Scoring stages this algorithm needs; a stage that is not needed is never started."""
        out: list[ServiceName] = []
        if self.algo.needs_reference:
            out.append("reference")
        out.append("reward")
        if self.algo.needs_critic:
            out.append("critic")
        return out

    def services_needed(self) -> list[ServiceName]:
        return ["controller", "actor", *self.stages()]

    def endpoint(self, name: ServiceName) -> Endpoint:
        return self.services.get(name) or _default_services()[name]

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def journal_dir(self) -> Path:
        return Path(self.journal.dir) if self.journal.dir else self.run_dir / "journal"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    def token(self) -> str | None:
        env = self.security.token_env
        return os.environ.get(env) or None if env else None

    def redis_password(self) -> str | None:
        env = self.redis.password_env
        return os.environ.get(env) or None if env else None


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "literal_error" and "expected" in e.get("ctx", {}):
            msg = f"got {e['input']!r}; allowed values: {e['ctx']['expected']}"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "<dict>", **overrides: Any) -> RunConfig:
    data = dict(data or {})
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | os.PathLike[str], **overrides: Any) -> RunConfig:
    """Load and validate a YAML run config. `overrides` use `section__key=value` names."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {p} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {p} must be a mapping at the top level, got {type(raw).__name__}")
    return parse_config(raw, source=str(p), **overrides)
