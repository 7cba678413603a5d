"""How rank 0 hands every follower the next command: a numbered key in the group's TCPStore
(waited on without a deadline, so an idle trainer never times out), then the command itself by
`broadcast_object_list`, whose collective timeout bounds a rank that hangs.

Commands are pickled, which is safe here and nowhere else: they only travel between the ranks
of one service, over a loopback store on one host; over several hosts the store's port must be
reachable from the group's own hosts only (deploy/README.md, "Beyond one host")."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How often a waiting follower looks up from the store to check that rank 0 still lives.
POLL = timedelta(seconds=5)


class Op(enum.Enum):
    TRAIN = "train"  # (rollout, step, version) -> stats
    SCORE = "score"  # (rollout,) -> values on rank 0 (the critic scores through its sharded model)
    FULL_STATE = "full_state"  # () -> the full state dict, on rank 0's CPU (weight sync)
    SAVE = "save"  # (directory,) -> DCP checkpoint of model and optimizer
    LOAD = "load"  # (checkpoint dir, layout) -> model and optimizer from a checkpoint of any layout
    LOAD_WEIGHTS = "load_weights"  # (safetensors files, optimizer state or None) -> UpdateWeights
    STOP = "stop"


@dataclass
class Command:
    op: Op
    args: tuple[Any, ...] = field(default_factory=tuple)


class RankError(RuntimeError):
    """A rank died, hung past the collective timeout or failed an op: the service must stop."""


def announce(store: dist.Store, seq: int, cmd: Command) -> None:
    store.set(f"cmd/{seq}", cmd.op.value)
    box: list[Any] = [cmd]
    dist.broadcast_object_list(box, src=0)


def receive(store: dist.Store, seq: int, parent: int) -> Command:
    """The next command, waiting as long as rank 0 lives. A dead rank 0 ends the wait: the store
    it served is gone (the wait raises) or this process was handed to another parent."""
    while True:
        try:
            store.wait([f"cmd/{seq}"], POLL)
            break
        except Exception as err:  # timeout and lost connection look alike from here
            if os.getppid() != parent:
                raise RankError("rank 0 is gone") from err
            if "timeout" not in str(err).lower():
                raise RankError(f"rank 0's store is unreachable: {err}") from err
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    cmd = box[0]
    assert isinstance(cmd, Command)
    return cmd
