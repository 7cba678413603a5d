"""The sharded checkpoint of a multi-rank trainer: torch.distributed.checkpoint (DCP) files in a
`dcp/` directory of the version directory, written by every rank, each its own shards, with
meta.json as today (checkpoint.py writes it, with `layout: dcp`, once every rank is done).

DCP stores the global shape of every tensor, so a checkpoint written by N ranks loads into any
number of ranks, one included (no process group: DCP then reads every shard itself), and into a
plain unsharded model for an export. Model and optimizer state go in one DCP save under the keys
`model` and `optim`, both keyed by parameter name (get_state_dict), not by position."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from services.models.checkpoints.layout import DCP_DIR

__all__ = ["DCP_DIR", "files_of", "full_options", "load_dcp", "save_dcp"]



def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_dcp(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """A collective when a process group is up: every rank calls it with the same directory."""
    dcp.save(_state(model, optimizer), checkpoint_id=str(directory))


def load_dcp(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load into `model` (and `optimizer`) whatever their sharding; a collective like save_dcp."""
    state = _state(model, optimizer)
    with warnings.catch_warnings():
        # Without a process group DCP reads every shard itself, as meant here; it warns that it does.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(directory))
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def files_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def full_options(cpu_offload: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
