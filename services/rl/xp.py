"""The few array operations the RL statistics need, on numpy arrays or torch tensors alike.

The masked reductions and the KL estimators are one implementation for both sides: the trainer's
losses call them on torch tensors (gradients flow), the controller's advantages and statistics on
numpy arrays (so it never imports torch). Each helper does what its torch counterpart does, picking
the backend from the array it is given; torch is imported only when a tensor is given, by which
time its caller has imported it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar
from typing import cast as _as

import numpy as np

if TYPE_CHECKING:
    import torch

# An array of either backend: a function taking one returns the same kind.
A = TypeVar("A", "np.ndarray[Any, Any]", "torch.Tensor")


def is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic)


def is_bool(x: Any) -> bool:
    """`x` holds bools (numpy or torch)."""
    return bool(x.dtype == np.bool_) if is_numpy(x) else bool(x.dtype == _torch().bool)


def _numpy_dtype(dtype: Any) -> bool:
    return isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic))


def acc_dtype(dtype: Any) -> Any:
    """The dtype statistics are accumulated in: float64 stays, everything else goes to float32."""
    if _numpy_dtype(dtype):
        return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def out_dtype(dtype: Any) -> Any:
    """Results keep a floating input's dtype; integer (and bool) inputs give float32."""
    if _numpy_dtype(dtype):
        return np.dtype(dtype) if np.issubdtype(dtype, np.floating) else np.dtype(np.float32)
    import torch

    return dtype if dtype.is_floating_point else torch.float32


def cast(x: A, dtype: Any) -> A:
    """`x.to(dtype)` (no copy when it already is that dtype)."""
    y: Any = x
    return _as(A, np.asarray(y).astype(dtype, copy=False) if is_numpy(y) else y.to(dtype))


def where(cond: Any, a: A, b: A) -> A:
    return _as(A, np.where(cond, a, b) if is_numpy(a) else _torch().where(cond, a, b))


def zeros_like(x: A) -> A:
    return _as(A, np.zeros_like(x) if is_numpy(x) else _torch().zeros_like(x))


def total(x: A, dim: int | tuple[int, ...] | None = None) -> A:
    """`x.sum(dim)`; every element without `dim` (a 0-d array for numpy)."""
    y: Any = x
    if is_numpy(y):
        return _as(A, np.asarray(np.asarray(y).sum(axis=dim)))
    return _as(A, y.sum(dim=dim) if dim is not None else y.sum())


def clamp(x: A, lo: float | None = None, hi: float | None = None) -> A:
    """`x.clamp(lo, hi)`, either bound optional."""
    y: Any = x
    return _as(A, np.asarray(np.clip(y, lo, hi)) if is_numpy(y) else y.clamp(lo, hi))


def expm1(x: A) -> A:
    return _as(A, np.expm1(x) if is_numpy(x) else _torch().expm1(x))


def rsqrt(x: A) -> A:
    if is_numpy(x):
        arr: Any = np.asarray(x)
        return _as(A, np.asarray(arr.dtype.type(1) / np.sqrt(arr)))
    return _as(A, _torch().rsqrt(x))


def broadcast_to(x: A, like: A) -> A:
    """`x.expand_as(like)`: a read-only view for numpy."""
    y: Any = x
    return _as(A, np.broadcast_to(y, np.shape(like)) if is_numpy(y) else y.expand_as(like))


def _torch() -> Any:
    import torch

    return torch
