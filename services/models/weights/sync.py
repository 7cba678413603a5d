"""Strict weight sync, shared by the engines: what `update_weights` accepts and how it says no.

Every parameter must be given (one name of a tied group is enough), no unknown name, no shape
mismatch, no name twice, and versions never go backwards; otherwise `WeightSyncError` names the
offenders and nothing is changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from services.models.engine import WeightsTorn, WeightSyncError


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


def shapes_only(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Meta tensors of these shapes: what `check_weights` needs of a sync that has not arrived yet."""
    return {n: torch.empty(s, device="meta") for n, s in shapes.items()}


def alias_expand(bucket: Iterable[tuple[str, torch.Tensor]], groups_of: Mapping[str, Sequence[str]],
                 done: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a streamed bucket under every name of its alias group (the engine's loader
    keeps the name it holds), each group once per sync: `done` collects the groups (by first name)
    already given, across the buckets of one sync."""
    for name, t in bucket:
        group = groups_of[name]
        if group[0] in done:
            continue
        done.add(group[0])
        for alias in group:
            yield alias, t


def stream_complete(done: set[str], groups: Iterable[Sequence[str]], version: int) -> None:
    """After the last bucket: every alias group arrived, else the sync tore (the stream ended early)."""
    missing = [g[0] for g in groups if g[0] not in done]
    if missing:
        raise WeightsTorn(f"weight sync to version {version} ended before {names(missing)} arrived")
