"""The padded rollout layout every stage agrees on.

Prompts are left-padded to P tokens and responses right-padded to R tokens, so that
`cat(prompt_ids, response_ids)` puts every response at the same columns and per-token tensors
(log-probs, values, advantages) are all `[B, R]`, aligned with `response_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


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
        b = len(self.task_ids)
        if self.prompt_ids.shape[0] != b or self.response_ids.shape[0] != b:
            raise ValueError(f"rollout rows disagree: {b} task ids, prompt {tuple(self.prompt_ids.shape)},"
                             f" response {tuple(self.response_ids.shape)}")
        if self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"prompt_mask shape {tuple(self.prompt_mask.shape)} != prompt_ids"
                             f" {tuple(self.prompt_ids.shape)}")
        r_shape = self.response_ids.shape
        per_token = ("response_mask", "behaviour_logprobs", "ref_logprobs", "values", "advantages", "returns")
        for name in per_token:
            t = getattr(self, name)
            if t is not None and t.shape != r_shape:
                raise ValueError(f"{name} shape {tuple(t.shape)} != response_ids {tuple(r_shape)}")
        for name in ("group_ids", "rewards", "versions"):
            t = getattr(self, name)
            if t is not None and t.shape != (b,):
                raise ValueError(f"{name} shape {tuple(t.shape)} != ({b},)")

    def __len__(self) -> int:
        return len(self.task_ids)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device` (no copy for tensors already there)."""
        kw = {f.name: getattr(self, f.name).to(device) for f in fields(self)
              if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **kw)

    def select(self, index: torch.Tensor | list[int]) -> Rollout:
        idx = torch.as_tensor(index, dtype=torch.long)
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "task_ids":
                kw[f.name] = [self.task_ids[i] for i in idx.tolist()]
            elif isinstance(v, torch.Tensor):
                kw[f.name] = v[idx]
        return replace(self, **kw)


def _pad_rows(rows: list[torch.Tensor], width: int, value: float | int, left: bool) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype if rows else torch.long)
    for i, r in enumerate(rows):
        n = r.shape[0]
        if n:
            if left:
                out[i, width - n:] = r
            else:
                out[i, :n] = r
    return out


def concat(parts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts whose P and R differ into one padded batch (versions kept per sample)."""
    if not parts:
        raise ValueError("concat needs at least one rollout")
    p_w = max(p.prompt_ids.shape[1] for p in parts)
    r_w = max(p.response_ids.shape[1] for p in parts)

    def rows(get, mask_get):  # type: ignore[no-untyped-def]
        return [t[m] for p in parts for t, m in zip(get(p), mask_get(p), strict=True)]

    def pm(p: Rollout) -> torch.Tensor:
        return p.prompt_mask

    def rm(p: Rollout) -> torch.Tensor:
        return p.response_mask

    prompt_ids = _pad_rows(rows(lambda p: p.prompt_ids, pm), p_w, pad_id, left=True)
    prompt_mask = _pad_rows(rows(lambda p: p.prompt_mask, pm), p_w, False, left=True)
    response_ids = _pad_rows(rows(lambda p: p.response_ids, rm), r_w, pad_id, left=False)
    response_mask = _pad_rows(rows(lambda p: p.response_mask, rm), r_w, False, left=False)
    out = Rollout(
        task_ids=[t for p in parts for t in p.task_ids],
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=_pad_rows(rows(lambda p: p.behaviour_logprobs, rm), r_w, 0.0, left=False),
        group_ids=torch.cat([p.group_ids for p in parts]),
        version=min(p.version for p in parts),
        versions=torch.cat([
            p.versions if p.versions is not None else torch.full((len(p),), p.version, dtype=torch.long)
            for p in parts
        ]),
    )
    for name in ("ref_logprobs", "values", "advantages", "returns"):
        if all(getattr(p, name) is not None for p in parts):
            setattr(out, name, _pad_rows(rows(lambda p, n=name: getattr(p, n), rm), r_w, 0.0, left=False))
    if all(p.rewards is not None for p in parts):
        out.rewards = torch.cat([p.rewards for p in parts])  # type: ignore[misc]
    return out
