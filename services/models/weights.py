"""Strict weight sync, shared by the engines: what `update_weights` accepts and how it says no.

Every parameter must be given (one name of a tied group is enough), no unknown name, no shape
mismatch, no name twice, and versions never go backwards; otherwise `WeightSyncError` names the
offenders and nothing is changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from services.models.engine import WeightSyncError


def names(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" … ({len(items)} in all)" if len(items) > limit else "")


def unique_named(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors by name; a name given more than once is an error."""
    incoming: dict[str, torch.Tensor] = {}
    dupes: list[str] = []
    for name, tensor in named_tensors:
        if name in incoming:
            dupes.append(name)
        incoming[name] = tensor
    if dupes:
        raise WeightSyncError(f"update_weights got names more than once: {names(dupes)}")
    return incoming


def check_version(version: int, current: int) -> None:
    if version < current:
        raise WeightSyncError(f"update_weights version {version} is older than the engine's version {current}")


def check_weights(
    incoming: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    alias_groups: Iterable[Sequence[str]],
) -> None:
    """Raise `WeightSyncError` unless `incoming` covers every alias group of a model whose state dict
    has `shapes`, with nothing unknown and every shape matching."""
    unknown = sorted(set(incoming) - set(shapes))
    mismatched = [
        f"{n} (got {tuple(t.shape)}, expected {shapes[n]})"
        for n, t in incoming.items()
        if n in shapes and tuple(t.shape) != shapes[n]
    ]
    missing = sorted(group[0] for group in alias_groups if not any(n in incoming for n in group))
    problems = []
    if unknown:
        problems.append(f"unknown names: {names(unknown)}")
    if missing:
        problems.append(f"missing names: {names(missing)}")
    if mismatched:
        problems.append(f"shape mismatch: {names(mismatched)}")
    if problems:
        raise WeightSyncError("update_weights rejected, nothing changed; " + "; ".join(problems))
