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


BUILTIN_TASKS: tuple[str, ...] = ("arithmetic", "sentiment", "synthetic")
FILE_SOURCES: tuple[str, ...] = ("jsonl", "json", "parquet", "csv")
TaskSource = Literal["jsonl", "json", "parquet", "csv", "hf", "reasoning_gym"]


def _absolute(path: str) -> str:
    # Services may start in another directory than the one the config was written for: a relative
    # path is pinned at parse time, so the fleet.yaml every service reads holds the same file.
    return os.path.abspath(os.path.expanduser(path))


class RewardSpec(_Strict):
    # "task" (the task's own reward), "math_verify", a function name in `task.reward_path`,
    # "package.module:function" or "path/to/file.py:function".
    fn: Annotated[str, Field(min_length=1)]
    weight: float = 1.0
    # The component's name in logs and metrics; defaults to the function's name.
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"must be a finite number, got {v}")
        return v


class TaskSection(_Strict):
    # A built-in task (no `source`), the generator of a reasoning-gym source, or a hub dataset id.
    name: str | None = None
    # Where prompts come from: unset for a built-in task; a file format; a `datasets` hub id or
    # local dataset directory ("hf"); or a reasoning-gym generator ("reasoning_gym").
    source: TaskSource | None = None
    # A file (or glob) for the file sources; a hub id or local directory for "hf".
    path: str | None = None
    # A held-out file for the file sources (read as split `eval_split`, default "test").
    eval_path: str | None = None
    # The dataset configuration name of a hub dataset (e.g. "main" for gsm8k).
    subset: str | None = None
    split: str = "train"
    # A named held-out split; without one, `eval_size` rows are held out of `split` (by `seed`).
    eval_split: str | None = None
    prompt_field: str = "prompt"
    # None: open-ended prompts without a reference answer.
    answer_field: str | None = "answer"
    # Reward keyword -> data column, for columns the reward wants under another name.
    fields: dict[str, str] = Field(default_factory=dict)
    # Render prompts through the tokenizer's chat template when it has one; false: raw text.
    chat: bool = True
    system_prompt: str | None = None
    # Training order: shuffled per epoch by `seed` (false: file order).
    shuffle: bool = True
    seed: int = 0
    # Task-specific knobs, validated by the task itself (see services.tasks); for reasoning-gym the
    # generator's config (e.g. min_terms, max_digits, size).
    params: dict[str, Any] = Field(default_factory=dict)
    # One reward function: "package.module:function" or "path/to/file.py:function".
    reward_fn: str | None = None
    # A Python file holding reward functions ("path.py") or one of them ("path.py:function"); it
    # is imported by path, so no process needs PYTHONPATH for it.
    reward_path: str | None = None
    # Several rewards summed with weights; each component is logged.
    rewards: list[RewardSpec] = Field(default_factory=list)
    eval_size: Annotated[int, Field(ge=0)] = 64

    @model_validator(mode="before")
    @classmethod
    def _absolute_data_paths(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        source = out.get("source")
        for key in ("path", "eval_path"):
            v = out.get(key)
            local = source in FILE_SOURCES or (source == "hf" and isinstance(v, str) and os.path.exists(v))
            if isinstance(v, str) and v and local:
                out[key] = _absolute(v)
        return out

    @field_validator("reward_fn")
    @classmethod
    def _module_colon_function(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"must look like 'package.module:function' or 'path/to/file.py:function', got {v!r}")
        if v is not None and v.split(":")[0].endswith(".py"):
            return f"{_absolute(v.split(':')[0])}:{v.split(':')[1]}"
        return v

    @field_validator("reward_path")
    @classmethod
    def _python_file(cls, v: str | None) -> str | None:
        if v is None:
            return v
        file, sep, fn = v.partition(":")
        if not file.endswith(".py") or (sep and not fn):
            raise ValueError(f"must look like 'path/to/file.py' or 'path/to/file.py:function', got {v!r}")
        return _absolute(file) + (f":{fn}" if sep else "")

    @model_validator(mode="after")
    def _source_needs(self) -> TaskSection:
        if self.source is None:
            if self.name is not None and self.name not in BUILTIN_TASKS:
                raise ValueError(
                    f"name: got {self.name!r}; allowed values: {', '.join(map(repr, BUILTIN_TASKS))}"
                    " (or set 'source' to train on a dataset)")
            for key in ("path", "eval_path", "subset", "eval_split"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: only used with a 'source' ({', '.join(FILE_SOURCES)}, hf)")
        elif self.source in FILE_SOURCES and self.path is None:
            raise ValueError(f"path: source {self.source!r} needs the data file")
        elif self.source == "hf" and self.path is None and self.name is None:
            raise ValueError("path: source 'hf' needs a hub dataset id or a local dataset directory")
        elif self.source == "reasoning_gym" and self.name is None:
            raise ValueError("name: source 'reasoning_gym' needs the generator name (e.g. basic_arithmetic)")
        if self.eval_path is not None and self.source not in FILE_SOURCES:
            raise ValueError(f"eval_path: only used with a file source ({', '.join(FILE_SOURCES)})")
        if self.rewards and self.reward_fn is not None:
            raise ValueError("set either 'reward_fn' or 'rewards', not both")
        if self.reward_fn is not None and self.reward_path is not None and ":" in self.reward_path:
            raise ValueError("reward_path names a function; set either it or 'reward_fn', not both")
        return self

    @property
    def task_name(self) -> str:
        """The built-in task to build when there is no `source`."""
        return self.name or "arithmetic"


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
    # A local GGUF file (model and tokenizer in one) dequantized once into `path` (or
    # RUN_DIR/models/<role>) when that does not exist yet: every service then loads the fast copy.
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Recompute activations in the backward pass of the trainers: less memory, about a third more compute.
    gradient_checkpointing: bool = False

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, v: str | None) -> str | None:
        return None if v is None else _absolute(v)

    @field_validator("gguf_file")
    @classmethod
    def _env_in_gguf_file(cls, v: str | None) -> str | None:
        # `${NAME}` takes the path from the environment, so a shipped example can point at a file
        # whose place depends on the install (examples/smollm2-arithmetic.yaml).
        if v is None:
            return v
        for name in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", v):
            if not os.environ.get(name):
                raise ValueError(f"{v!r} names the environment variable {name}, which is not set")
            v = v.replace("${" + name + "}", os.environ[name])
        return _absolute(v)

    @model_validator(mode="after")
    def _path_or_build(self) -> ModelSpec:
        if self.path is None and self.build is None and self.gguf_file is None:
            raise ValueError("set 'path' (a local model directory), 'build' (a tiny model spec) or"
                             " 'gguf_file' (a local GGUF file)")
        if self.build is not None and self.gguf_file is not None:
            raise ValueError("set at most one of 'build' and 'gguf_file': both say where the model comes from")
        if self.gguf_file is not None and not self.gguf_file.endswith(".gguf"):
            raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        return self


class ModelsSection(_Strict):
    policy: ModelSpec = Field(default_factory=lambda: ModelSpec(build=TinyModelSpec()))
    # None: the critic is the initial policy backbone plus a fresh scalar value head.
    critic: ModelSpec | None = None
    # None: the task's rule-based reward. A path: a sequence classifier with one label.
    reward: ModelSpec | None = None

    @model_validator(mode="after")
    def _gguf_policy_only(self) -> ModelsSection:
        # Only the policy is materialised from GGUF at start-up; the critic starts from that copy.
        for role in ("critic", "reward"):
            spec = getattr(self, role)
            if spec is not None and spec.gguf_file is not None:
                raise ValueError(f"{role}.gguf_file: only models.policy loads from a GGUF file; leave"
                                 f" models.{role} unset to start from the policy, or point its path at a model"
                                 " directory")
        return self


AlgoName = Literal["ppo", "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
KLName = Literal["k1", "k2", "k3", "low_var_kl", "abs"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
# Algorithms that compare each response with the others sampled for its prompt.
GROUP_ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp_baseline")
# What each algorithm means beyond its advantage estimator, as published; a field the user sets wins.
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    # Dr. GRPO (Liu et al. 2025): no std normalisation, constant loss normaliser.
    "dr_grpo": {"norm_std": False, "loss_agg": "seq_mean_token_sum_norm"},
    # DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level loss, soft overlong punishment.
    "dapo": {"clip_eps_high": 0.28, "loss_agg": "token_mean"},
    # GSPO (Zheng et al. 2025): sequence-level ratio, clipped at 3e-4 / 4e-4, sequence-mean loss.
    "gspo": {"clip_eps": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq_mean_token_mean"},
}


class AlgoSection(_Strict):
    name: AlgoName = "grpo"
    """Advantage estimator and objective; `dr_grpo`, `dapo` and `gspo` also change the defaults of
    the fields named in ALGO_DEFAULTS."""
    group_size: Annotated[int, Field(ge=1)] = 8
    kl_coef: Annotated[float, Field(ge=0)] = 0.0
    kl_estimator: KLName = "k3"
    """KL estimator of the KL-in-loss penalty (`kl_in: loss`)."""
    kl_estimator_reward: KLName = "k1"
    """KL estimator subtracted from the reward (`kl_in: reward`); k1 as verl's default."""
    kl_clamp: Annotated[float, Field(gt=0)] | None = 10.0
    """Bound on each token's KL estimate (verl, OpenRLHF: 10); null leaves it unbounded."""
    kl_in: Literal["reward", "loss"] = "loss"
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[float, Field(gt=0, lt=10)] | None = None
    dual_clip_c: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip PPO (Ye et al. 2020): the loss of a negative-advantage token is at most -c * A."""
    value_clip: Annotated[float, Field(gt=0)] = 0.2
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    norm_std: bool | None = None
    """Divide group advantages by the group's std (GRPO); null means the algorithm's own choice
    (off for dr_grpo, on otherwise)."""
    loss_agg: LossAgg = "token_mean"
    loss_norm_len: Annotated[int, Field(ge=1)] | None = None
    """Constant divisor of `seq_mean_token_sum_norm`; null means generation.max_new_tokens."""
    overlong_buffer_len: Annotated[int, Field(ge=1)] | None = None
    """DAPO's overlong window: responses longer than max_new_tokens - this many tokens lose reward
    linearly, up to `overlong_penalty_factor` at max_new_tokens. null: off (dapo: a quarter of the
    generation budget)."""
    overlong_penalty_factor: Annotated[float, Field(ge=0)] = 1.0
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

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            defaults = ALGO_DEFAULTS.get(str(data.get("name", "grpo")), {})
            data = {**defaults, **data}
        return data

    @model_validator(mode="after")
    def _groups(self) -> AlgoSection:
        if self.name in GROUP_ALGOS and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (got {self.group_size})")
        return self

    @property
    def group_norm_std(self) -> bool:
        return self.norm_std if self.norm_std is not None else self.name != "dr_grpo"

    @property
    def ratio_level(self) -> Literal["token", "sequence"]:
        return "sequence" if self.name == "gspo" else "token"

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
        """Keyword arguments for `services.models.factory.make_engine`."""
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
    # Port 0 everywhere: the launcher picks distinct free ports for the whole fleet, so two fleets on
    # one host never collide. Deployments that need fixed ports (compose, Kubernetes) set them.
    return {n: Endpoint() for n in SERVICE_NAMES}


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

    @model_validator(mode="before")
    @classmethod
    def _generation_budget_defaults(cls, data: Any) -> Any:
        """Algorithm fields whose default is a share of the generation budget."""
        if not isinstance(data, dict) or not isinstance(data.get("algo", {}), dict):
            return data
        algo = dict(data.get("algo") or {})
        gen = data.get("generation") or {}
        budget = gen.get("max_new_tokens", GenerationSection.model_fields["max_new_tokens"].default) \
            if isinstance(gen, dict) else gen.max_new_tokens
        if not isinstance(budget, int):
            return data  # the generation section reports its own error
        agg = algo.get("loss_agg", ALGO_DEFAULTS.get(str(algo.get("name")), {}).get("loss_agg"))
        if agg == "seq_mean_token_sum_norm":
            algo.setdefault("loss_norm_len", budget)
        if algo.get("name") == "dapo":
            algo.setdefault("overlong_buffer_len", max(1, budget // 4))
        return {**data, "algo": algo}

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
        ov = self.algo.overlong_buffer_len
        if ov is not None and ov > self.generation.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer_len ({ov}) must be at most generation.max_new_tokens"
                             f" ({self.generation.max_new_tokens})")
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
        """Tasks the controller may have in flight: (max_staleness + 1) x samples_per_step."""
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
        return _secret("security.token_env", self.security.token_env)

    def redis_password(self) -> str | None:
        return _secret("redis.password_env", self.redis.password_env)

    def check_secrets(self) -> None:
        """Fail closed at start-up: a secret the config names but the environment lacks is a
        `ConfigError` naming the variable, never a fleet running without it."""
        self.token()
        self.redis_password()


def _secret(field: str, env: str | None) -> str | None:
    if not env:
        return None
    value = os.environ.get(env)
    if not value:
        state = "unset" if value is None else "empty"
        raise ConfigError(f"{field} names the environment variable {env}, but {env} is {state}; export it"
                          f" (or remove {field} to run without it)")
    return value


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
