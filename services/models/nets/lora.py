"""LoRA adapters on the trained policy, through peft (`models.policy.lora`).

The trainer holds a peft model: the base weights frozen, the adapters the only trainable (and
optimized) parameters, never merged in place. What leaves the trainer is one of two views of it:

* the engine gets MERGED weights at every sync (`engine_weights`): the base model's own names and
  shapes, each adapted layer's weight plus peft's delta (what peft's `merge` adds), taken out of
  place, so the trainer's base weights are never touched (an in-place merge and unmerge rounds
  them: W + d - d != W);
* a checkpoint holds the adapters only (`adapter_state` / `load_adapter_state`), in peft's own
  adapter naming, so resume loads the base from `models.policy.path` and the adapters exactly.

The reference role loads the base model directory, so the KL term is measured against the base.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

from services.core.config.run import ConfigError, LoraSpec, ModelSpec
from services.models.engine import WeightSyncError
from services.models.io.loading import load_causal_lm
from services.models.weights.sync import check_weights, names

if TYPE_CHECKING:
    from peft import PeftModel

FIELD = "models.policy.lora"


def is_lora(model: nn.Module) -> bool:
    """True for a peft model; peft is only imported by runs that use it."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_names(model: nn.Module) -> set[str]:
    """The leaf names of the model's linear layers that can take adapters: every nn.Linear but the
    output head (tied to the input embedding in most small models, so it cannot be merged alone)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head}


def check_targets(model: nn.Module, spec: LoraSpec) -> None:
    """A `ConfigError` naming the first target that is not a linear layer of `model`."""
    if spec.target_modules == "all-linear":
        return
    known = linear_names(model)
    for name in spec.target_modules:
        if name not in known:
            raise ConfigError(f"{FIELD}.target_modules: {name!r} is not a linear layer of {type(model).__name__};"
                              f" its linear layers are {', '.join(sorted(known))}")


def apply_lora(model: nn.Module, spec: LoraSpec, seed: int) -> PeftModel:
    """`model` with fresh LoRA adapters (B = 0, so it scores exactly like `model`). A's random init
    is drawn from `seed` on a forked generator: the fleet's actor and the local loop start equal,
    and nobody else's random stream moves."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError(f"{FIELD}: LoRA needs the peft package: pip install 'rlfleet[lora]'") from None
    check_targets(model, spec)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,  # type: ignore[arg-type]
                        target_modules=spec.target_modules, bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, config)  # type: ignore[arg-type]
    wrapped.eval()
    return wrapped


def load_policy(spec: ModelSpec, path: Path, device: str, seed: int) -> PreTrainedModel:
    """The policy a trainer updates: the causal LM at `path`, wrapped with LoRA adapters when
    `spec.lora` is set (the actor and the local loop build it the same way). A peft model passes
    attribute reads (`config`, ...) through to the model it wraps."""
    model = load_causal_lm(path, dtype=spec.dtype, device=device)
    return model if spec.lora is None else apply_lora(model, spec.lora, seed)  # type: ignore[return-value]


def check_only_adapters_train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer holds exactly the adapters' parameters (an AssertionError otherwise): a frozen
    base that still moved would make the engine's merged weights and the checkpoint disagree."""
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert adapters and optimized == adapters, "the LoRA optimizer must hold the adapter parameters and nothing else"


# -- engine: merged weights ----------------------------------------------------------------------


def _adapted_layers(model: PeftModel) -> dict[str, Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, BaseTunerLayer)}


def _merged_layer(layer: Any) -> dict[str, torch.Tensor]:
    """One adapted layer's base state with its active adapters merged. peft's merge adds
    `get_delta_weight` (B @ A * scale, in peft's layout and dtype handling) to the base weight in
    place; here the same sum is taken out of place, so the trainer's weight is never written (an
    in-place merge then unmerge rounds it: W + d - d != W) and no module is copied (merging a deep
    copy of every layer made a sync 7x slower). It stays bit-equal to `merge_and_unload`
    (tests/unit/test_models_lora.py). Only plain LoRA is built here (no DoRA, no adapter bias)."""
    base = layer.get_base_layer()
    out = dict(base.state_dict())
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if adapter in layer.lora_variant or layer.lora_bias.get(adapter):
            raise WeightSyncError(f"adapter {adapter!r} is not plain LoRA; rlfleet merges plain LoRA only")
        # In-place `+=` computes in the promoted dtype and rounds to the weight's: the same here.
        out["weight"] = torch.add(out["weight"], layer.get_delta_weight(adapter)).to(out["weight"].dtype)
    return out


@torch.no_grad()
def merged_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in: the names and shapes a model
    loaded from `models.policy.path` has. Unadapted tensors are the trainer's own (not copied)."""
    base = model.get_base_model()
    layers = _adapted_layers(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        parts = name.split(".")
        if not any(".".join(parts[:i]) in layers for i in range(1, len(parts))):
            out[name] = tensor
    for prefix, layer in layers.items():
        for pname, tensor in _merged_layer(layer).items():
            out[f"{prefix}.{pname}"] = tensor
    return out


def engine_weights(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """What a weight sync sends the engine: the state dict, merged for a LoRA policy (only that
    path pays for the merge)."""
    if is_lora(model):
        return merged_state(model).items()  # type: ignore[arg-type]
    return model.state_dict().items()


# -- checkpoints: the adapters only --------------------------------------------------------------


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapters' weights by peft's names (what `save_pretrained` writes as adapter_model)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: PeftModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter weights into `model` in place, all or nothing: every adapter tensor must be
    there with its shape and nothing else (a `WeightSyncError` naming the offenders)."""
    from peft import set_peft_model_state_dict

    want = {k: tuple(v.shape) for k, v in adapter_state(model).items()}
    check_weights(tensors, want, [[k] for k in want])
    result = set_peft_model_state_dict(model, dict(tensors))
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise WeightSyncError(f"adapter weights peft did not place: {names(unexpected)}")
