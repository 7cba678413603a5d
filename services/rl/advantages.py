"""Advantage estimators for PPO (GAE), GRPO (and Dr. GRPO), RLOO, REINFORCE++ (and its group-baseline
variant), and DAPO's overlong reward shaping.

Everything here works on the padded `[B, R]` response layout and treats only masked tokens as the
trajectory: padding is skipped (never a time step) and always comes out as 0. The recursions
handle any mask, not only the contiguous-from-column-0 layout rollouts use, so a response whose
mask ends early, or has a hole, still sees its real tokens as consecutive steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.rl.masked import acc_dtype, as_bool_mask, masked_whiten, out_dtype


def _check_rows(name: str, t: Tensor, mask: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, R], got shape {tuple(mask.shape)}")
    if t.shape != mask.shape[:1]:
        raise ValueError(f"{name} shape {tuple(t.shape)} != ({mask.shape[0]},)")


def _check_tokens(name: str, t: Tensor, mask: Tensor) -> None:
    if t.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != mask {tuple(mask.shape)}")


def _float_dtype(*ts: Tensor) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return out_dtype(dtype)


def _active_cols(m: Tensor) -> int:
    """Columns up to and including the last one any row uses; the recursions stop there."""
    used = m.any(dim=0).nonzero()
    return int(used.max().item()) + 1 if used.numel() else 0


def _broadcast_rows(per_row: Tensor, m: Tensor, dtype: torch.dtype) -> Tensor:
    v = per_row.to(dtype)[:, None].expand(m.shape)
    return torch.where(m, v, torch.zeros_like(v))


def token_level_rewards(
    scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Sequence score on each row's last real token, minus `kl_coef * kl` on every real token.

    Putting the score on the last token makes the per-token return equal the sequence score
    (gamma = 1), which is what GAE and REINFORCE++ expect from an outcome reward.
    """
    m = as_bool_mask(mask)
    _check_rows("scores", scores, m)
    dtype = _float_dtype(scores) if kl is None else _float_dtype(scores, kl)
    b, r = m.shape
    out = torch.zeros((b, r), dtype=dtype, device=m.device)
    if r > 0:
        col = torch.arange(r, device=m.device)
        last = torch.where(m, col, torch.full_like(col, -1)).max(dim=1).values  # -1: empty row
        at_last = col[None, :] == last[:, None]  # never true for an empty row
        out = torch.where(at_last, scores.to(dtype)[:, None].expand(b, r), out)
    if kl is not None and kl_coef != 0.0:
        _check_tokens("kl", kl, m)
        kl_m = torch.where(m, kl.to(dtype), torch.zeros_like(out))
        out = out - kl_coef * kl_m
    return out


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over masked tokens; returns (advantages, returns).

    The value after a row's last real token is 0 (the response ended, or was cut: either way no
    bootstrap). Advantages are not whitened here, so the critic's returns stay unscaled.
    """
    _check_tokens("token_rewards", token_rewards, mask)
    _check_tokens("values", values, mask)
    m = as_bool_mask(mask, values)
    dtype = _float_dtype(token_rewards, values)
    acc = acc_dtype(dtype)
    zeros = torch.zeros(m.shape, dtype=acc, device=m.device)
    rew = torch.where(m, token_rewards.to(acc), zeros)
    val = torch.where(m, values.to(acc), zeros)
    b = m.shape[0]
    next_v = torch.zeros(b, dtype=acc, device=m.device)
    next_a = torch.zeros(b, dtype=acc, device=m.device)
    n = _active_cols(m)
    cols: list[Tensor] = []
    for t in reversed(range(n)):
        mt = m[:, t]
        delta = rew[:, t] + gamma * next_v - val[:, t]
        a = delta + (gamma * lam) * next_a
        cols.append(torch.where(mt, a, torch.zeros_like(a)))
        # Padding is not a time step: carry the next real token's value and advantage across it.
        next_v = torch.where(mt, val[:, t], next_v)
        next_a = torch.where(mt, a, next_a)
    adv = zeros.clone()
    if n:
        adv[:, :n] = torch.stack(cols[::-1], dim=1)
    ret = torch.where(m, adv + val, zeros)
    return adv.to(dtype), ret.to(dtype)


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per sample: the dense index of its group, and that group's size."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def _group_sum(x: Tensor, inverse: Tensor, n_groups: int) -> Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def grpo_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, norm_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """(score - group mean) / (group std + eps), broadcast over each row's real tokens.

    The std is unbiased; a group of one has no baseline to compare against and gets 0.
    """
    m = as_bool_mask(mask)
    _check_rows("scores", scores, m)
    _check_rows("group_ids", group_ids, m)
    dtype = _float_dtype(scores)
    s = scores.to(torch.float64)  # [B] only: float64 is free and keeps group means exact
    inverse, counts = _group_index(group_ids)
    n = counts.to(torch.float64)
    mean = _group_sum(s, inverse, len(counts)) / n
    dev = s - mean[inverse]
    if norm_std:
        var = _group_sum(dev * dev, inverse, len(counts)) / (n - 1).clamp(min=1)
        dev = dev / (var.sqrt()[inverse] + eps)
    adv = torch.where(counts[inverse] >= 2, dev, torch.zeros_like(dev))
    return _broadcast_rows(adv, m, dtype)


def group_mean_baseline(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Score minus its group's mean (REINFORCE++-baseline's first step); a group of one gets 0."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be [B]")
    s = scores.to(torch.float64)
    inverse, counts = _group_index(group_ids)
    mean = _group_sum(s, inverse, len(counts)) / counts.to(torch.float64)
    out = torch.where(counts[inverse] >= 2, s - mean[inverse], torch.zeros_like(s))
    return out.to(out_dtype(scores.dtype))


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment: 0 up to `max_len - buffer_len` tokens, then falling linearly
    to `-factor` at `max_len` (and beyond), so truncated responses are penalised by how far into the
    buffer they ran rather than all at once."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    expected = max_len - buffer_len
    frac = (expected - lengths.to(torch.float64)) / buffer_len
    return (factor * frac.clamp(-1.0, 0.0)).to(torch.float32)


def rloo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """Score minus the mean of the other members of its group (leave-one-out); singletons get 0."""
    m = as_bool_mask(mask)
    _check_rows("scores", scores, m)
    _check_rows("group_ids", group_ids, m)
    dtype = _float_dtype(scores)
    s = scores.to(torch.float64)
    inverse, counts = _group_index(group_ids)
    total = _group_sum(s, inverse, len(counts))[inverse]
    n = counts[inverse].to(torch.float64)
    others_mean = (total - s) / (n - 1).clamp(min=1)
    adv = torch.where(n >= 2, s - others_mean, torch.zeros_like(s))
    return _broadcast_rows(adv, m, dtype)


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Discounted return-to-go over real tokens, whitened over the whole batch (REINFORCE++).

    Whitening across the batch, not per group, is the variance reduction REINFORCE++ uses in place
    of a critic or a group baseline.
    """
    _check_tokens("token_rewards", token_rewards, mask)
    m = as_bool_mask(mask, token_rewards)
    dtype = _float_dtype(token_rewards)
    acc = acc_dtype(dtype)
    zeros = torch.zeros(m.shape, dtype=acc, device=m.device)
    rew = torch.where(m, token_rewards.to(acc), zeros)
    running = torch.zeros(m.shape[0], dtype=acc, device=m.device)
    n = _active_cols(m)
    cols: list[Tensor] = []
    for t in reversed(range(n)):
        mt = m[:, t]
        g = rew[:, t] + gamma * running
        cols.append(torch.where(mt, g, torch.zeros_like(g)))
        running = torch.where(mt, g, running)
    ret = zeros.clone()
    if n:
        ret[:, :n] = torch.stack(cols[::-1], dim=1)
    return masked_whiten(ret, m).to(dtype)
