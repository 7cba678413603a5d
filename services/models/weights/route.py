"""How weight syncs reach an engine's process, decided without torch: `engines.boot` asks before the actor
imports it, `weight_transfer` and `factory` when they build the transfer."""

from __future__ import annotations

from typing import Literal

TRANSFERS: tuple[str, ...] = ("auto", "ipc", "collective")


def route(transfer: str, *, shares_trainer_device: bool) -> Literal["ipc", "collective"] | None:
    """`auto` is ipc where the engine sees the trainer's device (or both are on the CPU), else collective;
    None for a name that is not a transfer."""
    if transfer == "auto":
        return "ipc" if shares_trainer_device else "collective"
    if transfer == "ipc":
        return "ipc"
    return "collective" if transfer == "collective" else None
