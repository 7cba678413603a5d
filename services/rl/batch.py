"""The padded rollout layout every stage agrees on, as numpy arrays and as torch tensors.

Prompts are left-padded to P tokens and responses right-padded to R tokens, so that
`cat(prompt_ids, response_ids)` puts every response at the same columns and per-token tensors
(log-probs, values, advantages) are all `[B, R]`, aligned with `response_ids`.

`RolloutArrays` holds the layout in numpy: what the controller joins, concatenates, computes
advantages on and sends (`services.rl.pipeline`), and what a reward function scores. `Rollout`
holds it in torch tensors: what the models generate, score and train on. Both hold exactly what a
RolloutBatch / TrainBatch carries (int64 ids, bool masks, float32 values), and convert into each
other sharing memory (`Rollout.arrays`, `RolloutArrays.to_rollout`). This module imports numpy only:
the torch side imports torch where it runs, which is only ever in a process that holds tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

Array = np.ndarray[Any, Any]

# Per-token [B, R] fields and per-row [B] fields, beyond the ids and masks; with their wire dtypes.
PER_TOKEN = ("response_mask", "behaviour_logprobs", "ref_logprobs", "values", "advantages", "returns")
PER_ROW = ("group_ids", "rewards", "versions")
SCORED = ("ref_logprobs", "values", "advantages", "returns")  # per-token floats filled after generation
WIRE_DTYPES: dict[str, Any] = {
    "prompt_ids": np.int64, "prompt_mask": np.bool_, "response_ids": np.int64, "response_mask": np.bool_,
    "behaviour_logprobs": np.float32, "group_ids": np.int64, "versions": np.int64,
    **dict.fromkeys((*SCORED, "rewards"), np.float32),
}


def _check_layout(r: Any) -> None:
    """The shapes of a rollout's fields agree (numpy or torch alike)."""
    b = len(r.task_ids)
    if r.prompt_ids.shape[0] != b or r.response_ids.shape[0] != b:
        raise ValueError(f"rollout rows disagree: {b} task ids, prompt {tuple(r.prompt_ids.shape)},"
                         f" response {tuple(r.response_ids.shape)}")
    if r.prompt_mask.shape != r.prompt_ids.shape:
        raise ValueError(f"prompt_mask shape {tuple(r.prompt_mask.shape)} != prompt_ids {tuple(r.prompt_ids.shape)}")
    r_shape = tuple(r.response_ids.shape)
    for name in PER_TOKEN:
        t = getattr(r, name)
        if t is not None and tuple(t.shape) != r_shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != response_ids {r_shape}")
    for name in PER_ROW:
        t = getattr(r, name)
        if t is not None and tuple(t.shape) != (b,):
            raise ValueError(f"{name} shape {tuple(t.shape)} != ({b},)")


@dataclass
class RolloutArrays:
    """The rollout layout in numpy (see the module docstring); fields as in `Rollout`."""

    task_ids: list[str]
    prompt_ids: Array  # [B, P] int64
    prompt_mask: Array  # [B, P] bool
    response_ids: Array  # [B, R] int64
    response_mask: Array  # [B, R] bool
    behaviour_logprobs: Array  # [B, R] float32
    group_ids: Array  # [B] int64
    version: int = 0
    versions: Array | None = None  # [B] int64
    ref_logprobs: Array | None = None  # [B, R] float32
    values: Array | None = None  # [B, R] float32
    rewards: Array | None = None  # [B] float32
    advantages: Array | None = None  # [B, R] float32
    returns: Array | None = None  # [B, R] float32

    def __post_init__(self) -> None:
        _check_layout(self)

    def __len__(self) -> int:
        return len(self.task_ids)

    def select(self, index: Sequence[int] | Array) -> RolloutArrays:
        """The rows `index`, in that order (copies)."""
        idx = np.asarray(index, dtype=np.int64)
        kw: dict[str, Any] = {"task_ids": [self.task_ids[i] for i in idx.tolist()]}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                kw[f.name] = v[idx]
        return replace(self, **kw)

    def to_rollout(self) -> Rollout:
        """The torch Rollout, sharing these arrays' memory."""
        import torch

        kw: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, v in kw.items():
            if isinstance(v, np.ndarray):
                kw[name] = torch.from_numpy(v)
        return Rollout(**kw)


def _array(t: torch.Tensor | None, name: str) -> Array | None:
    """A tensor as its wire dtype's numpy array on the CPU (no copy when it already is one)."""
    if t is None:
        return None
    import torch

    want = WIRE_DTYPES[name]
    cast = {np.int64: torch.int64, np.bool_: torch.bool, np.float32: torch.float32}[want]
    return t.detach().to(device="cpu", dtype=cast).numpy()


@dataclass
class Rollout:
    task_ids: list[str]
    prompt_ids: torch.Tensor  # [B, P] int64, left-padded with pad_id
    prompt_mask: torch.Tensor  # [B, P] bool
    response_ids: torch.Tensor  # [B, R] int64, right-padded with pad_id
    response_mask: torch.Tensor  # [B, R] bool, True on generated tokens (the loss mask)
    behaviour_logprobs: torch.Tensor  # [B, R] float32, log-probs under the generating policy
    group_ids: torch.Tensor  # [B] int64, samples of one prompt share a group id
    version: int = 0  # policy version the rollout was generated under
    # Filled in by the scoring stages and the controller.
    ref_logprobs: torch.Tensor | None = None  # [B, R]
    values: torch.Tensor | None = None  # [B, R]
    rewards: torch.Tensor | None = None  # [B] sequence-level score
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    versions: torch.Tensor | None = field(default=None)  # [B] per-sample generation version

    def __post_init__(self) -> None:
        _check_layout(self)

    def __len__(self) -> int:
        return len(self.task_ids)

    @property
    def input_ids(self) -> torch.Tensor:
        import torch

        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        import torch

        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device` (no copy for tensors already there)."""
        import torch

        kw = {f.name: getattr(self, f.name).to(device) for f in fields(self)
              if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **kw)

    def select(self, index: torch.Tensor | list[int]) -> Rollout:
        import torch

        idx = torch.as_tensor(index, dtype=torch.long)
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "task_ids":
                kw[f.name] = [self.task_ids[i] for i in idx.tolist()]
            elif isinstance(v, torch.Tensor):
                kw[f.name] = v[idx]
        return replace(self, **kw)

    def arrays(self) -> RolloutArrays:
        """This rollout as the wire carries it: numpy on the CPU, int64 ids, bool masks, float32
        values (sharing memory where a tensor already is that)."""
        kw: dict[str, Any] = {"task_ids": list(self.task_ids), "version": self.version}
        for f in fields(RolloutArrays):
            if f.name not in kw:
                kw[f.name] = _array(getattr(self, f.name), f.name)
        return RolloutArrays(**kw)


AnyRollout = TypeVar("AnyRollout", Rollout, RolloutArrays)


def _pad_rows(rows: list[Array], width: int, value: float | int, left: bool, dtype: Any) -> Array:
    out = np.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        n = r.shape[0]
        if n:
            if left:
                out[i, width - n:] = r
            else:
                out[i, :n] = r
    return out


def concat(parts: Sequence[AnyRollout], pad_id: int) -> AnyRollout:
    """Stack rollouts whose P and R differ into one padded batch (versions kept per sample); the
    parts' kind comes back: torch Rollouts are stacked through their arrays, by the same code."""
    if not parts:
        raise ValueError("concat needs at least one rollout")
    if isinstance(parts[0], Rollout):
        return _concat([p.arrays() for p in parts], pad_id).to_rollout()  # type: ignore[union-attr,return-value]
    return _concat(parts, pad_id)  # type: ignore[arg-type,return-value]


def _concat(parts: Sequence[RolloutArrays], pad_id: int) -> RolloutArrays:
    p_w = max(p.prompt_ids.shape[1] for p in parts)
    r_w = max(p.response_ids.shape[1] for p in parts)

    def rows(name: str, mask: str) -> list[Array]:
        return [t[m] for p in parts for t, m in zip(getattr(p, name), getattr(p, mask), strict=True)]

    def pad(name: str, mask: str, value: float | int, left: bool = False) -> Array:
        return _pad_rows(rows(name, mask), p_w if left else r_w, value, left, WIRE_DTYPES[name])

    out = RolloutArrays(
        task_ids=[t for p in parts for t in p.task_ids],
        prompt_ids=pad("prompt_ids", "prompt_mask", pad_id, left=True),
        prompt_mask=pad("prompt_mask", "prompt_mask", False, left=True),
        response_ids=pad("response_ids", "response_mask", pad_id),
        response_mask=pad("response_mask", "response_mask", False),
        behaviour_logprobs=pad("behaviour_logprobs", "response_mask", 0.0),
        group_ids=np.concatenate([p.group_ids for p in parts]).astype(np.int64, copy=False),
        version=min(p.version for p in parts),
        versions=np.concatenate([
            p.versions if p.versions is not None else np.full((len(p),), p.version, dtype=np.int64) for p in parts
        ]).astype(np.int64, copy=False),
    )
    for name in SCORED:
        if all(getattr(p, name) is not None for p in parts):
            setattr(out, name, pad(name, "response_mask", 0.0))
    if all(p.rewards is not None for p in parts):
        out.rewards = np.concatenate([p.rewards for p in parts]).astype(np.float32, copy=False)  # type: ignore[misc]
    return out
