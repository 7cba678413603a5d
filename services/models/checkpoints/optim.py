"""Optimizer state in a checkpoint: tensors to safetensors, everything else to JSON (nothing pickled).

Per-parameter tensors (exp_avg, exp_avg_sq, ...) go to `optimizer.safetensors` as
`state.<param_index>.<name>`; hyper-parameters, step counts and other scalars go to
`optimizer.json` with their dtype, so the round trip is exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from services.models.checkpoints.layout import (
    FORMAT,
    OPTIM_JSON_FILE,
    OPTIM_TENSORS_FILE,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
)


def split_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state dict -> (tensors for safetensors, JSON document).

    Per-parameter tensors (exp_avg, exp_avg_sq, ...) go to safetensors as `state.<index>.<name>`.
    Scalars, including AdamW's 0-d `step` tensors and a tensor lr, go to JSON with their dtype, so
    the step counts are readable and the round trip is exact (a float32 count is an exact double)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state_doc: dict[str, dict[str, Any]] = {}
    for index, per_param in sd["state"].items():
        entry: dict[str, Any] = {}
        for name, value in per_param.items():
            where = f"state.{index}.{name}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[where] = value.detach().contiguous()
            else:
                entry[name] = to_json(value, where)
        state_doc[str(index)] = entry
    groups = [
        {k: (list(v) if k == "params" else to_json(v, f"param_groups.{g}.{k}")) for k, v in group.items()}
        for g, group in enumerate(sd["param_groups"])
    ]
    return tensors, {
        "format": FORMAT,
        "class": type(optimizer).__name__,
        "param_groups": groups,
        "state": state_doc,
    }


def to_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise CheckpointError(f"optimizer {where} is a tensor of shape {tuple(value.shape)}; only scalars fit JSON")
        return {"$scalar": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):  # betas: kept a tuple so the restored state dict equals the saved one
        return {"$tuple": [to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    raise CheckpointError(f"optimizer {where} is a {type(value).__name__}, which a checkpoint cannot hold")


def from_json(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [from_json(v, where) for v in value]
    if isinstance(value, dict):
        if "$tuple" in value:
            return tuple(from_json(v, where) for v in value["$tuple"])
        if "$scalar" in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointCorrupt(f"optimizer {where}: unknown dtype {value.get('dtype')!r}")
            return torch.tensor(value["$scalar"], dtype=dtype)
        raise CheckpointCorrupt(f"optimizer {where}: unexpected object {sorted(value)}")
    return value


def read_optimizer_state(path: Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state dict of an already verified checkpoint (sha256 matched)."""
    try:
        doc = json.loads((path / OPTIM_JSON_FILE).read_bytes())
        tensors = load_file(str(path / OPTIM_TENSORS_FILE))
    except (OSError, ValueError) as err:
        raise CheckpointCorrupt(f"optimizer state in {path} cannot be read: {err}") from err
    if doc.get("class") != type(optimizer).__name__:
        raise CheckpointMismatch(
            f"{path / OPTIM_JSON_FILE} holds {doc.get('class')} state, not {type(optimizer).__name__}"
        )
    try:
        state: dict[int, dict[str, Any]] = {
            int(index): {name: from_json(v, f"state.{index}.{name}") for name, v in entry.items()}
            for index, entry in doc["state"].items()
        }
        for key, tensor in tensors.items():
            prefix, index, name = key.split(".", 2)
            if prefix != "state":
                raise ValueError(f"unexpected tensor {key!r}")
            state.setdefault(int(index), {})[name] = tensor
        groups = [
            {k: (v if k == "params" else from_json(v, f"param_groups.{g}.{k}")) for k, v in group.items()}
            for g, group in enumerate(doc["param_groups"])
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        # The sha256 matched, so this is a file we wrote wrongly, not disk damage; still unusable.
        raise CheckpointCorrupt(f"optimizer state in {path} is malformed: {type(err).__name__}: {err}") from err
    return {"state": state, "param_groups": groups}
