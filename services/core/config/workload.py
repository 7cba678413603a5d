"""Config sections for what a run trains on: the task (prompts, rewards) and the models."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from services.core.config.base import Strict as _Strict

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
    # Seconds a configured reward (`reward_fn`, `reward_path`, `rewards`) may take on one batch (one
    # rollout message, or one evaluation pass), the isolation of its failing rows included. It runs
    # in a child process of its service: past this the child is killed and restarted, the batch's
    # tasks end dead with reason `reward_timeout` (an evaluation counts its rows unscored), and the
    # run goes on. A task's own built-in reward runs in-process, unbounded.
    reward_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 60.0

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


class LoraSpec(_Strict):
    """LoRA adapters (through peft) on the trained policy: only the adapters train, the engine gets
    the merged weights at every sync, the reference scores with the base model."""

    r: Annotated[int, Field(ge=1)] = 8
    """The adapters' rank."""
    alpha: Annotated[float, Field(gt=0)] = 16.0
    """Scale numerator: the update is B @ A * alpha / r."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input while training. Above 0 it draws from torch's global random
    state, which a checkpoint does not hold: a resumed run is then no longer bit-for-bit."""
    target_modules: list[Annotated[str, Field(min_length=1)]] | Literal["all-linear"] = "all-linear"
    """Names of the linear layers that get adapters (e.g. [q_proj, v_proj]), each checked against
    the model at start-up; "all-linear": every linear layer but the output head."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and not v:
            raise ValueError("name at least one module, or use 'all-linear'")
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError(f"names a module more than once: {v}")
        return v


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
    # LoRA adapters instead of full fine-tuning (models.policy only); None: every weight trains.
    lora: LoraSpec | None = None

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
        for role in ("critic", "reward"):
            spec = getattr(self, role)
            if spec is not None and spec.lora is not None:
                raise ValueError(f"{role}.lora: only models.policy trains LoRA adapters; remove models.{role}.lora")
        return self
