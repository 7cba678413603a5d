"""Reductions over the response mask.

Padding may hold anything (zeros, stale log-probs, even inf), so every reduction selects with
`torch.where` instead of multiplying by the mask: `inf * 0` is NaN, a select is not. Statistics
accumulate in float32 (float64 stays float64) and are cast back to the input dtype, so bf16
inputs do not lose the batch mean to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

Dim = int | tuple[int, ...] | None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are accumulated in: float64 stays, everything else goes to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """Results keep a floating input's dtype; integer inputs give float32."""
    return dtype if dtype.is_floating_point else torch.float32


def as_bool_mask(mask: Tensor, like: Tensor | None = None) -> Tensor:
    """A bool mask, broadcast to `like`'s shape if given (0/1 masks accepted: nonzero means real)."""
    m = mask if mask.dtype == torch.bool else mask != 0
    return m if like is None else m.expand_as(like)


def _count(mask: Tensor, dim: Dim, dtype: torch.dtype) -> Tensor:
    return mask.sum(dim=dim).to(dtype) if dim is not None else mask.sum().to(dtype)


def _sum(x: Tensor, dim: Dim) -> Tensor:
    return x.sum(dim=dim) if dim is not None else x.sum()


def masked_sum(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of `x` over positions where `mask` is true; 0 where there are none."""
    m = as_bool_mask(mask, x)
    xa = x.to(acc_dtype(x.dtype))
    return _sum(torch.where(m, xa, torch.zeros_like(xa)), dim).to(out_dtype(x.dtype))


def masked_mean(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean over masked positions; 0 (not NaN) where the mask is empty."""
    m = as_bool_mask(mask, x)
    acc = acc_dtype(x.dtype)
    xa = x.to(acc)
    total = _sum(torch.where(m, xa, torch.zeros_like(xa)), dim)
    # An empty slice has total 0, so dividing by max(count, 1) yields 0 without a host sync.
    return (total / _count(m, dim, acc).clamp(min=1)).to(out_dtype(x.dtype))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked elements (two-pass, for accuracy); 0 with fewer than 2 elements."""
    m = as_bool_mask(mask, x)
    acc = acc_dtype(x.dtype)
    xa = x.to(acc)
    n = m.sum().to(acc)
    mean = torch.where(m, xa, torch.zeros_like(xa)).sum() / n.clamp(min=1)
    centered = torch.where(m, xa - mean, torch.zeros_like(xa))
    denom = (n - 1) if unbiased else n
    var = (centered * centered).sum() / denom.clamp(min=1)
    var = torch.where(n >= 2, var, torch.zeros_like(var))
    return var.to(out_dtype(x.dtype))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise to unit variance over masked elements (unbiased var); padding is set to 0.

    With `shift_mean=False` the mean is kept, so the sign of a batch-wide advantage survives.
    """
    m = as_bool_mask(mask, x)
    acc = acc_dtype(x.dtype)
    xa = x.to(acc)
    mean = masked_mean(xa, m)
    var = masked_var(xa, m, unbiased=True)
    white = (xa - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return torch.where(m, white, torch.zeros_like(white)).to(out_dtype(x.dtype))
