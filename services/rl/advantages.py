"""Advantage estimators for PPO (GAE), GRPO (and Dr. GRPO), RLOO, REINFORCE++ (and its group-baseline
variant), and DAPO's overlong reward shaping.

Everything here works on the padded `[B, R]` response layout and treats only masked tokens as the
trajectory: padding is skipped (never a time step) and always comes out as 0. The recursions
handle any mask, not only the contiguous-from-column-0 layout rollouts use, so a response whose
mask ends early, or has a hole, still sees its real tokens as consecutive steps.

numpy, not torch: advantages are computed before training, on the controller (which never imports
torch) and in the local loop, by this one code (`services.rl.pipeline`). Inputs are array-likes (a
CPU tensor converts without a copy); outputs are numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.rl.masked import as_bool_mask, masked_whiten
from services.rl.xp import acc_dtype, out_dtype

Array = np.ndarray[Any, Any]


def _check_rows(name: str, t: Array, mask: Array) -> None:
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, R], got shape {tuple(mask.shape)}")
    if t.shape != mask.shape[:1]:
        raise ValueError(f"{name} shape {tuple(t.shape)} != ({mask.shape[0]},)")


def _check_tokens(name: str, t: Array, mask: Array) -> None:
    if t.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != mask {tuple(mask.shape)}")


def _float_dtype(*ts: Array) -> np.dtype[Any]:
    """The widest floating dtype among the inputs (float32 when none is floating), as torch promotes."""
    floats = [t.dtype for t in ts if np.issubdtype(t.dtype, np.floating)]
    return np.dtype(out_dtype(np.result_type(*floats)) if floats else np.float32)


def _mask(mask: Any, like: Array | None = None) -> Array:
    return as_bool_mask(np.asarray(mask), like)


def _active_cols(m: Array) -> int:
    """Columns up to and including the last one any row uses; the recursions stop there."""
    used = np.flatnonzero(m.any(axis=0))
    return int(used.max()) + 1 if used.size else 0


def _broadcast_rows(per_row: Array, m: Array, dtype: np.dtype[Any]) -> Array:
    v = np.broadcast_to(per_row.astype(dtype)[:, None], m.shape)
    return np.where(m, v, np.zeros((), dtype))


def token_level_rewards(scores: Any, mask: Any, kl: Any = None, kl_coef: float = 0.0) -> Array:
    """Sequence score on each row's last real token, minus `kl_coef * kl` on every real token.

    Putting the score on the last token makes the per-token return equal the sequence score
    (gamma = 1), which is what GAE and REINFORCE++ expect from an outcome reward.
    """
    m, scores = _mask(mask), np.asarray(scores)
    _check_rows("scores", scores, m)
    kl = None if kl is None else np.asarray(kl)
    dtype = _float_dtype(scores) if kl is None else _float_dtype(scores, kl)
    b, r = m.shape
    out = np.zeros((b, r), dtype=dtype)
    if r > 0:
        col = np.arange(r)
        last = np.where(m, col, -1).max(axis=1)  # -1: empty row
        at_last = col[None, :] == last[:, None]  # never true for an empty row
        out = np.where(at_last, scores.astype(dtype)[:, None], out)
    if kl is not None and kl_coef != 0.0:
        _check_tokens("kl", kl, m)
        kl_m = np.where(m, kl.astype(dtype), np.zeros_like(out))
        out = out - kl_coef * kl_m
    return out


def gae(token_rewards: Any, values: Any, mask: Any, gamma: float, lam: float) -> tuple[Array, Array]:
    """Generalised advantage estimation over masked tokens; returns (advantages, returns).

    The value after a row's last real token is 0 (the response ended, or was cut: either way no
    bootstrap). Advantages are not whitened here, so the critic's returns stay unscaled.
    """
    token_rewards, values, mask = np.asarray(token_rewards), np.asarray(values), np.asarray(mask)
    _check_tokens("token_rewards", token_rewards, mask)
    _check_tokens("values", values, mask)
    m = _mask(mask, values)
    dtype = _float_dtype(token_rewards, values)
    acc = acc_dtype(dtype)
    zeros = np.zeros(m.shape, dtype=acc)
    rew = np.where(m, token_rewards.astype(acc), zeros)
    val = np.where(m, values.astype(acc), zeros)
    b = m.shape[0]
    next_v = np.zeros(b, dtype=acc)
    next_a = np.zeros(b, dtype=acc)
    n = _active_cols(m)
    cols: list[Array] = []
    for t in reversed(range(n)):
        mt = m[:, t]
        delta = rew[:, t] + gamma * next_v - val[:, t]
        a = delta + (gamma * lam) * next_a
        cols.append(np.where(mt, a, np.zeros_like(a)))
        # Padding is not a time step: carry the next real token's value and advantage across it.
        next_v = np.where(mt, val[:, t], next_v)
        next_a = np.where(mt, a, next_a)
    adv = zeros.copy()
    if n:
        adv[:, :n] = np.stack(cols[::-1], axis=1)
    ret = np.where(m, adv + val, zeros)
    return adv.astype(dtype), ret.astype(dtype)


def _group_index(group_ids: Array) -> tuple[Array, Array]:
    """Per sample: the dense index of its group, and that group's size."""
    _, inverse, counts = np.unique(np.asarray(group_ids), return_inverse=True, return_counts=True)
    return inverse.reshape(-1), counts


def _group_sum(x: Array, inverse: Array, n_groups: int) -> Array:
    out = np.zeros(n_groups, dtype=x.dtype)
    np.add.at(out, inverse, x)  # in row order, as torch's index_add_
    return out


def grpo_advantages(scores: Any, group_ids: Any, mask: Any, norm_std: bool = True, eps: float = 1e-6) -> Array:
    """(score - group mean) / (group std + eps), broadcast over each row's real tokens.

    The std is unbiased; a group of one has no baseline to compare against and gets 0.
    """
    m, scores, group_ids = _mask(mask), np.asarray(scores), np.asarray(group_ids)
    _check_rows("scores", scores, m)
    _check_rows("group_ids", group_ids, m)
    dtype = _float_dtype(scores)
    s = scores.astype(np.float64)  # [B] only: float64 is free and keeps group means exact
    inverse, counts = _group_index(group_ids)
    n = counts.astype(np.float64)
    mean = _group_sum(s, inverse, len(counts)) / n
    dev = s - mean[inverse]
    if norm_std:
        var = _group_sum(dev * dev, inverse, len(counts)) / np.maximum(n - 1, 1)
        dev = dev / (np.sqrt(var)[inverse] + eps)
    adv = np.where(counts[inverse] >= 2, dev, np.zeros_like(dev))
    return _broadcast_rows(adv, m, dtype)


def group_mean_baseline(scores: Any, group_ids: Any) -> Array:
    """Score minus its group's mean (REINFORCE++-baseline's first step); a group of one gets 0."""
    scores, group_ids = np.asarray(scores), np.asarray(group_ids)
    if scores.ndim != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be [B]")
    s = scores.astype(np.float64)
    inverse, counts = _group_index(group_ids)
    mean = _group_sum(s, inverse, len(counts)) / counts.astype(np.float64)
    out = np.where(counts[inverse] >= 2, s - mean[inverse], np.zeros_like(s))
    return out.astype(out_dtype(scores.dtype))


def overlong_penalty(lengths: Any, max_len: int, buffer_len: int, factor: float) -> Array:
    """DAPO's soft overlong punishment: 0 up to `max_len - buffer_len` tokens, then falling linearly
    to `-factor` at `max_len` (and beyond), so truncated responses are penalised by how far into the
    buffer they ran rather than all at once."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    expected = max_len - buffer_len
    frac = (expected - np.asarray(lengths).astype(np.float64)) / buffer_len
    return (factor * np.clip(frac, -1.0, 0.0)).astype(np.float32)


def rloo_advantages(scores: Any, group_ids: Any, mask: Any) -> Array:
    """Score minus the mean of the other members of its group (leave-one-out); singletons get 0."""
    m, scores, group_ids = _mask(mask), np.asarray(scores), np.asarray(group_ids)
    _check_rows("scores", scores, m)
    _check_rows("group_ids", group_ids, m)
    dtype = _float_dtype(scores)
    s = scores.astype(np.float64)
    inverse, counts = _group_index(group_ids)
    total = _group_sum(s, inverse, len(counts))[inverse]
    n = counts[inverse].astype(np.float64)
    others_mean = (total - s) / np.maximum(n - 1, 1)
    adv = np.where(n >= 2, s - others_mean, np.zeros_like(s))
    return _broadcast_rows(adv, m, dtype)


def reinforce_pp_advantages(token_rewards: Any, mask: Any, gamma: float) -> Array:
    """Discounted return-to-go over real tokens, whitened over the whole batch (REINFORCE++).

    Whitening across the batch, not per group, is the variance reduction REINFORCE++ uses in place
    of a critic or a group baseline.
    """
    token_rewards, mask = np.asarray(token_rewards), np.asarray(mask)
    _check_tokens("token_rewards", token_rewards, mask)
    m = _mask(mask, token_rewards)
    dtype = _float_dtype(token_rewards)
    acc = acc_dtype(dtype)
    zeros = np.zeros(m.shape, dtype=acc)
    rew = np.where(m, token_rewards.astype(acc), zeros)
    running = np.zeros(m.shape[0], dtype=acc)
    n = _active_cols(m)
    cols: list[Array] = []
    for t in reversed(range(n)):
        mt = m[:, t]
        g = rew[:, t] + gamma * running
        cols.append(np.where(mt, g, np.zeros_like(g)))
        running = np.where(mt, g, running)
    ret = zeros.copy()
    if n:
        ret[:, :n] = np.stack(cols[::-1], axis=1)
    return masked_whiten(ret, m).astype(dtype)
