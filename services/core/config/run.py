"""The run configuration: one YAML file, validated once at start-up.

Every service, the CLI and the local loop read the same `RunConfig`. Unknown keys are errors
(`extra="forbid"`) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

# The sections of what a run trains on and of the algorithm live in modules of their own; every
# name stays importable from here, the one config module the rest of the code knows.
from services.core.config.algo import ALGO_DEFAULTS, GROUP_ALGOS, AlgoName, AlgoSection, KLName, LossAgg
from services.core.config.base import ConfigError, RunCannotContinue
from services.core.config.base import Strict as _Strict
from services.core.config.generation import BehaviourLogprobs, GenerationSection
from services.core.config.trackers import TrackerSpec
from services.core.config.workload import (
    BUILTIN_TASKS,
    FILE_SOURCES,
    LoraSpec,
    ModelSpec,
    ModelsSection,
    RewardSpec,
    TaskSection,
    TaskSource,
    TinyModelSpec,
)

__all__ = [
    "ALGO_DEFAULTS",
    "BUILTIN_TASKS",
    "FILE_SOURCES",
    "GROUP_ALGOS",
    "SCORING_STAGES",
    "SERVICE_NAMES",
    "AlgoName",
    "AlgoSection",
    "BehaviourLogprobs",
    "ConfigError",
    "GenerationSection",
    "KLName",
    "LoraSpec",
    "LossAgg",
    "ModelSpec",
    "ModelsSection",
    "RewardSpec",
    "RunCannotContinue",
    "RunConfig",
    "ServiceName",
    "TaskSection",
    "TaskSource",
    "TinyModelSpec",
    "load_config",
    "parse_config",
]

ServiceName = Literal["controller", "actor", "critic", "reward", "reference"]
SERVICE_NAMES: tuple[ServiceName, ...] = ("controller", "actor", "critic", "reward", "reference")
SCORING_STAGES: tuple[ServiceName, ...] = ("reference", "reward", "critic")


class RunSection(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "tiny"
    dir: str = "runs/tiny"
    seed: int = 0
    max_steps: Annotated[int, Field(ge=1)] = 30
    # Evaluate mean reward on held-out prompts every N steps (0 = only before and after).
    eval_every: Annotated[int, Field(ge=0)] = 0
    # Experiment trackers every metrics row also goes to (TensorBoard, W&B, MLflow); none by default.
    trackers: list[TrackerSpec] = Field(default_factory=list)
    cuda_mps: bool = False
    """`rlfleet up` starts a CUDA MPS control daemon of its own and runs every service as its client:
    the kernels of services sharing a GPU then run side by side instead of time-slicing (engine decode
    beside the trainer's step). Needs `nvidia-cuda-mps-control` on the host and a service on a CUDA
    device; not for docker compose or Kubernetes, whose containers would have to share the daemon.
    Measure before turning it on: at 0.5B on one H200 the trainer sped up but the generation that
    paced the step slowed, 0.75x overall (BENCHMARKS.md, 2026-12-03)."""


class BatchSection(_Strict):
    # Prompts admitted per training step; each is sampled `algo.group_size` times.
    prompts_per_step: Annotated[int, Field(ge=1)] = 16
    # Prompts per message on the prompts stream: the unit of scoring, of delivery and of redelivery.
    # The actor generates up to generation.batch_messages waiting messages in one engine call.
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
    # Trainer ranks of the actor or the critic: N > 1 starts N - 1 follower processes (one per rank,
    # torch.distributed, FSDP2) beside the service process, which is rank 0. On CUDA rank r trains
    # on cuda:r of the visible devices, so the device group (CUDA_VISIBLE_DEVICES) needs N GPUs;
    # `rlfleet plan` reads this field to size the group. On the CPU every rank trains on the CPU.
    trainer_ranks: Annotated[int, Field(ge=1, le=64)] = 1

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

    def room(self, fill: float) -> int:
        """Messages a producer may take at once at this fill ratio: those that fit below the high
        watermark, at least one (as many as one at a time would let through before the hold)."""
        return max(1, math.ceil((self.high_watermark - fill) * self.stream_capacity - 1e-9))


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
        self._check_engine_replicas()
        for name, ep in self.services.items():
            if ep.trainer_ranks > 1 and name not in ("actor", "critic"):
                raise ValueError(
                    f"services.{name}.trainer_ranks: only the trainable services (actor, critic) train on"
                    f" several ranks, got {ep.trainer_ranks}"
                )
        if self.models.policy.lora is not None and self.endpoint("actor").trainer_ranks > 1:
            raise ValueError("models.policy.lora with services.actor.trainer_ranks > 1: LoRA adapters train on one"
                             " rank (FSDP2 sharding of a peft model is not supported); set trainer_ranks 1")
        if (self.generation.behaviour_logprobs == "trainer" and self.algo.needs_reference
                and self.algo.kl_in == "reward"):
            raise ValueError("generation.behaviour_logprobs 'trainer' excludes algo.kl_in 'reward' (its KL penalty"
                             " needs the engine's behaviour log-probs): set kl_in 'loss', or behaviour_logprobs"
                             " 'engine'")
        ov = self.algo.overlong_buffer_len
        if ov is not None and ov > self.generation.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer_len ({ov}) must be at most generation.max_new_tokens"
                             f" ({self.generation.max_new_tokens})")
        if self.run.cuda_mps and not any(self.endpoint(n).device.startswith("cuda") for n in SERVICE_NAMES):
            raise ValueError("run.cuda_mps: no service runs on a CUDA device (services.<name>.device), so MPS"
                             " would share nothing; set run.cuda_mps: false")
        if self.batch.prompts_per_step % self.batch.prompts_per_message:
            raise ValueError(
                f"batch.prompts_per_step ({self.batch.prompts_per_step}) must be a multiple of"
                f" batch.prompts_per_message ({self.batch.prompts_per_message})"
            )
        return self

    def _check_engine_replicas(self) -> None:
        """generation.replicas x tensor_parallel_size against the actor's device group: each replica on
        GPUs of its own, or (tensor_parallel_size 1) replicas sharing the group's GPUs."""
        g = self.generation
        group = self.endpoint("actor").device_group
        if group is None or (g.replicas == 1 and g.tensor_parallel_size == 1):
            return
        gpus = self.actor_gpu_count
        need = g.replicas * g.tensor_parallel_size
        if gpus < need and g.tensor_parallel_size > 1:
            raise ValueError(f"generation.replicas {g.replicas} x tensor_parallel_size {g.tensor_parallel_size} needs"
                             f" {need} GPUs; the actor's device group '{group}' has {gpus} (replicas share GPUs"
                             " only with tensor_parallel_size 1)")

    @property
    def actor_gpu_count(self) -> int:
        """GPUs of the actor's device group (0 without one): what engine replicas and trainer ranks share."""
        group = self.endpoint("actor").device_group
        if group is None:
            return 0
        dg = self.devices[group]
        return len(dg.ids) if dg.ids is not None else (dg.count or 0)

    # -- derived -------------------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        return self.batch.prompts_per_step * self.algo.group_size

    @property
    def admission_window(self) -> int:
        """The most tasks in flight (admitted, not yet trained or dead): the staleness budget. With
        `flow.max_staleness` n, generation may run up to n steps ahead of training. Plus one message
        less one group: groups that leave a batch (a row the reward could not score; with dynamic
        sampling, groups the filter drops) leave fewer tasks in flight than the steps need, and the
        controller then still admits, so a step that is one group short can always admit its next
        message. A run that loses no group holds whole messages in flight, so this slack (less than
        a message) admits nothing more there."""
        extra = (self.batch.prompts_per_message - 1) * self.algo.group_size
        return (self.flow.max_staleness + 1) * self.samples_per_step + extra

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
        elif e["type"] == "union_tag_invalid":  # a tagged list entry such as run.trackers[i].kind
            msg = f"{e['ctx']['discriminator']}: got {e['ctx']['tag']!r}; allowed values: {e['ctx']['expected_tags']}"
        elif e["type"] == "union_tag_not_found":
            msg = f"missing key {e['ctx']['discriminator']}"
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
