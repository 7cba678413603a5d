"""Reward models: a sequence classifier with one label, loaded from a local directory.

Sequences are scored left-padded (real tokens flush right, positions counted from the first real
token), so the classifier's last-token pooling always lands on the sequence's last real token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from services.core.config.run import TinyModelSpec
from services.models.io.atomic import MARKER, is_complete, staging_dir
from services.models.io.loading import ModelLoadError, load_tokenizer, require_model_dir, torch_dtype
from services.models.nets.logprobs import position_ids_from_mask
from services.models.roles.tiny import tiny_config
from services.models.roles.tokenizer import build_tokenizer
from services.tasks.base import Task

log = logging.getLogger(__name__)


class RewardModel:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, micro_batch: int = 0):
        n = int(getattr(model.config, "num_labels", 1))
        if n != 1:
            raise ModelLoadError(f"a reward model must have exactly one label, this one has {n}")
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.micro_batch = micro_batch
        self.device = next(model.parameters()).device

    @classmethod
    def load(cls, path: Path, dtype: str = "float32", device: str = "cpu", micro_batch: int = 0) -> RewardModel:
        path = require_model_dir(Path(path), "reward model")
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=torch_dtype(dtype), local_files_only=True
            )
        except ModelLoadError:
            raise
        except Exception as err:
            raise ModelLoadError(f"cannot load a sequence classifier from {path}: {type(err).__name__}: {err}") \
                from err
        return cls(model.to(device), load_tokenizer(path), micro_batch=micro_batch)

    @torch.no_grad()
    def score_ids(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[B]` float32 scores. `input_ids` is a list of token-id sequences, or a `[B, T]` tensor with
        its `attention_mask` in any padding layout (e.g. a rollout's `input_ids`/`attention_mask`,
        padded in the middle): padding is dropped and rows are re-packed left-padded."""
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
            sequences: Sequence[Sequence[int]] = [
                row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask, strict=True)
            ]
        else:
            sequences = input_ids
        if not sequences:
            return torch.zeros(0, dtype=torch.float32)
        if any(len(s) == 0 for s in sequences):
            raise ValueError("cannot score an empty sequence")
        pad = int(self.tokenizer.pad_token_id)
        step = self.micro_batch or len(sequences)
        out = []
        for start in range(0, len(sequences), step):
            chunk = sequences[start:start + step]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, s in enumerate(chunk):
                ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
                mask[i, width - len(s):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
            ).logits
            out.append(logits.reshape(len(chunk)).float().cpu())
        return torch.cat(out)

    def score_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """`[B]` scores of full texts (prompt + completion), tokenized with the model's tokenizer."""
        enc = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        return self.score_ids(enc)

    def score_rollout(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """`[B]` scores of `prompt + response` rows in the rollout layout."""
        return self.score_ids(
            torch.cat([prompt_ids, response_ids], dim=1), torch.cat([prompt_mask.bool(), response_mask.bool()], dim=1)
        )


def load_reward_model(path: Path, dtype: str = "float32", device: str = "cpu", micro_batch: int = 0) -> RewardModel:
    """A one-label sequence classifier + its tokenizer from a local directory."""
    return RewardModel.load(path, dtype=dtype, device=device, micro_batch=micro_batch)


def build_tiny_reward_model(
    task: Task, out_dir: Path, seed: int, spec: TinyModelSpec | None = None
) -> Path:
    """A randomly initialised one-label sequence classifier + tokenizer at `out_dir` (for tests and
    smoke runs: it scores, it does not judge). Written atomically like `build_tiny_model`."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    spec = spec or TinyModelSpec()
    tokenizer = build_tokenizer(task)
    config = tiny_config(spec, tokenizer, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = (
            Qwen2ForSequenceClassification(config) if isinstance(config, Qwen2Config)
            else LlamaForSequenceClassification(config)
        )
    info = {"kind": "reward_model", "task": task.name, "task_params": dict(task.params),
            "spec": spec.model_dump(), "seed": seed}
    with staging_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
    log.info("built tiny reward model for %s at %s", task.name, out_dir)
    return out_dir
