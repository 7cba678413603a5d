"""The value model: a causal-LM backbone (the transformers base model) plus a scalar value head.

Convention: `values[:, t]` is V(s_t), the value of the state in which response token t is about to
be generated, i.e. after the prompt and response tokens 0..t-1. It is read from the hidden state at
the position preceding response token t (column P + t - 1 of `cat(prompt, response)`), the same
position whose logits produce token t, so values align with `response_ids`, log-probs and advantages.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from services.models.io.loading import ModelLoadError, require_model_dir, torch_dtype
from services.models.nets.logprobs import position_ids_from_mask

log = logging.getLogger(__name__)

HEAD_FILE = "value_head.safetensors"
INFO_FILE = "rlfleet_value.json"


class ValueModel(nn.Module):
    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        if head is None:
            # Zero init: every state starts valued at 0, a neutral baseline; the head learns first.
            head = nn.Linear(hidden, 1)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        if head.in_features != hidden or head.out_features != 1:
            raise ValueError(f"value head must map {hidden} -> 1, got {head.in_features} -> {head.out_features}")
        # The head stays float32 whatever the backbone dtype: values are regression targets.
        self.value_head = head.float()

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_policy(cls, path: Path, dtype: str = "float32", device: str = "cpu") -> ValueModel:
        """Backbone initialised from the policy at `path` (its LM head is dropped), fresh zero head."""
        return cls(_load_backbone(path, dtype)).to(device)

    @classmethod
    def load(cls, path: Path, dtype: str = "float32", device: str = "cpu") -> ValueModel:
        path = Path(path)
        head_file = path / HEAD_FILE
        if not head_file.is_file():
            raise ModelLoadError(f"value model directory {path} has no {HEAD_FILE}")
        backbone = _load_backbone(path, dtype)
        try:
            state = load_file(str(head_file))
        except Exception as err:
            raise ModelLoadError(f"cannot read {head_file}: {type(err).__name__}: {err}") from err
        hidden = int(backbone.config.hidden_size)
        head = nn.Linear(hidden, 1)
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ModelLoadError(f"{head_file} does not fit a {hidden} -> 1 value head: {err}") from None
        return cls(backbone, head).to(device)

    def save(self, path: Path) -> None:
        """Backbone via `save_pretrained` (safetensors) and the head as `value_head.safetensors`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path, safe_serialization=True)
        head = {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(head, str(path / HEAD_FILE))
        (path / INFO_FILE).write_text(json.dumps({"kind": "value_model", "head": HEAD_FILE}))

    # -- compute -------------------------------------------------------------------------------
    def values(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """`[B, R]` float32 values of the states before each response token; 0 at response padding."""
        p, r = prompt_ids.shape[1], response_ids.shape[1]
        if p == 0:
            raise ValueError("prompts must have at least one column")
        if r == 0:
            return torch.zeros(prompt_ids.shape[0], 0, dtype=torch.float32, device=prompt_ids.device)
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        mask = torch.cat([prompt_mask.bool(), response_mask.bool()], dim=1)
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=mask.long(),
            position_ids=position_ids_from_mask(mask),
            use_cache=False,
        )
        hidden = out.last_hidden_state[:, p - 1 : p + r - 1]
        v = self.value_head(hidden.float()).squeeze(-1)
        return v.masked_fill(~response_mask.bool(), 0.0)

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        return self.values(prompt_ids, prompt_mask, response_ids, response_mask)


def _load_backbone(path: Path, dtype: str) -> PreTrainedModel:
    path = require_model_dir(Path(path), "value model backbone")
    try:
        backbone = AutoModel.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as err:
        raise ModelLoadError(f"cannot load a backbone from {path}: {type(err).__name__}: {err}") from err
    return backbone  # type: ignore[no-any-return]
