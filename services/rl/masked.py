"""Reductions over the response mask, on torch tensors (the trainer's losses) or numpy arrays (the
controller's advantages and statistics) alike: one implementation, the result of the input's kind
(`services.rl.xp`).

Padding may hold anything (zeros, stale log-probs, even inf), so every reduction selects with
`where` instead of multiplying by the mask: `inf * 0` is NaN, a select is not. Statistics
accumulate in float32 (float64 stays float64) and are cast back to the input dtype, so bf16
inputs do not lose the batch mean to rounding.
"""

from __future__ import annotations

from services.rl import xp
from services.rl.xp import A, acc_dtype, out_dtype

__all__ = ["Dim", "acc_dtype", "as_bool_mask", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
           "out_dtype"]

Dim = int | tuple[int, ...] | None


def as_bool_mask(mask: A, like: A | None = None) -> A:
    """A bool mask, broadcast to `like`'s shape if given (0/1 masks accepted: nonzero means real)."""
    m = mask if xp.is_bool(mask) else mask != 0
    return m if like is None else xp.broadcast_to(m, like)


def _count(mask: A, dim: Dim, dtype: object) -> A:
    return xp.cast(xp.total(mask, dim), dtype)


def masked_sum(x: A, mask: A, dim: Dim = None) -> A:
    """Sum of `x` over positions where `mask` is true; 0 where there are none."""
    m = as_bool_mask(mask, x)
    xa = xp.cast(x, acc_dtype(x.dtype))
    return xp.cast(xp.total(xp.where(m, xa, xp.zeros_like(xa)), dim), out_dtype(x.dtype))


def masked_mean(x: A, mask: A, dim: Dim = None) -> A:
    """Mean over masked positions; 0 (not NaN) where the mask is empty."""
    m = as_bool_mask(mask, x)
    acc = acc_dtype(x.dtype)
    xa = xp.cast(x, acc)
    total = xp.total(xp.where(m, xa, xp.zeros_like(xa)), dim)
    # An empty slice has total 0, so dividing by max(count, 1) yields 0 without a host sync.
    return xp.cast(total / xp.clamp(_count(m, dim, acc), lo=1), out_dtype(x.dtype))


def masked_var(x: A, mask: A, unbiased: bool = True) -> A:
    """Variance over all masked elements (two-pass, for accuracy); 0 with fewer than 2 elements."""
    m = as_bool_mask(mask, x)
    acc = acc_dtype(x.dtype)
    xa = xp.cast(x, acc)
    n = _count(m, None, acc)
    mean = xp.total(xp.where(m, xa, xp.zeros_like(xa))) / xp.clamp(n, lo=1)
    centered = xp.where(m, xa - mean, xp.zeros_like(xa))
    denom = (n - 1) if unbiased else n
    var = xp.total(centered * centered) / xp.clamp(denom, lo=1)
    var = xp.where(n >= 2, var, xp.zeros_like(var))
    return xp.cast(var, out_dtype(x.dtype))


def masked_whiten(x: A, mask: A, shift_mean: bool = True, eps: float = 1e-8) -> A:
    """Normalise to unit variance over masked elements (unbiased var); padding is set to 0.

    With `shift_mean=False` the mean is kept, so the sign of a batch-wide advantage survives.
    """
    m = as_bool_mask(mask, x)
    acc = acc_dtype(x.dtype)
    xa = xp.cast(x, acc)
    mean = masked_mean(xa, m)
    var = masked_var(xa, m, unbiased=True)
    white = (xa - mean) * xp.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return xp.cast(xp.where(m, white, xp.zeros_like(white)), out_dtype(x.dtype))
