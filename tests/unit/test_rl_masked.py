"""Masked reductions: checked against float64 loop references, padding garbage included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from services.rl.masked import masked_mean, masked_sum, masked_var, masked_whiten

R = 6
# A full row, a padded row, an empty row, a single-token row, another padded row.
LENGTHS = [6, 3, 0, 1, 4]


def lengths_mask(lengths: list[int], width: int = R) -> torch.Tensor:
    return torch.tensor([[t < n for t in range(width)] for n in lengths])


def batch(seed: int = 0, pad: float = 1e6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = lengths_mask(LENGTHS)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 3 + 1
    return torch.where(mask, x, torch.full_like(x, pad)), mask


def cells(x: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, int, float]]:
    return [(i, t, float(x[i, t])) for i in range(x.shape[0]) for t in range(x.shape[1]) if bool(mask[i, t])]


def ref_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    b, r = x.shape
    if dim is None:
        return torch.tensor(sum(v for _, _, v in cells(x, mask)), dtype=torch.float64)
    size = b if dim == 1 else r
    out = [0.0] * size
    for i, t, v in cells(x, mask):
        out[i if dim == 1 else t] += v
    return torch.tensor(out, dtype=torch.float64)


def ref_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    b, r = x.shape
    if dim is None:
        vals = [v for _, _, v in cells(x, mask)]
        return torch.tensor(sum(vals) / len(vals) if vals else 0.0, dtype=torch.float64)
    size = b if dim == 1 else r
    sums, counts = [0.0] * size, [0] * size
    for i, t, v in cells(x, mask):
        k = i if dim == 1 else t
        sums[k] += v
        counts[k] += 1
    return torch.tensor([s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)], dtype=torch.float64)


def ref_var(vals: list[float], unbiased: bool) -> float:
    n = len(vals)
    if n < 2:
        return 0.0
    mean = sum(vals) / n
    return sum((v - mean) ** 2 for v in vals) / (n - 1 if unbiased else n)


def ref_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
    vals = [v for _, _, v in cells(x, mask)]
    mean = sum(vals) / len(vals) if vals else 0.0
    std = math.sqrt(ref_var(vals, unbiased=True) + eps)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i, t, v in cells(x, mask):
        out[i, t] = (v - mean) / std + (0.0 if shift_mean else mean)
    return out


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_masked_sum_matches_loop_reference_over_each_dim(dim: int | None) -> None:
    x, mask = batch()
    assert_close(masked_sum(x, mask, dim=dim), ref_sum(x, mask, dim))


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_masked_mean_matches_loop_reference_over_each_dim(dim: int | None) -> None:
    x, mask = batch()
    assert_close(masked_mean(x, mask, dim=dim), ref_mean(x, mask, dim))


def test_masked_mean_is_zero_for_a_row_with_empty_mask() -> None:
    x, mask = batch()
    row_means = masked_mean(x, mask, dim=1)
    assert row_means[2].item() == 0.0
    assert torch.isfinite(row_means).all()


def test_masked_reductions_of_fully_empty_mask_are_zero_not_nan() -> None:
    x, _ = batch()
    empty = torch.zeros(x.shape, dtype=torch.bool)
    for out in (masked_sum(x, empty), masked_mean(x, empty), masked_var(x, empty)):
        assert out.item() == 0.0
    assert (masked_mean(x, empty, dim=1) == 0).all()
    assert (masked_whiten(x, empty) == 0).all()


def test_masked_reductions_ignore_inf_and_nan_in_padding() -> None:
    x, mask = batch()
    dirty = x.clone()
    dirty[~mask] = float("inf")
    dirty[0, 0] = x[0, 0]  # keep a real value
    dirty[1, 5] = float("nan")
    assert_close(masked_sum(dirty, mask), ref_sum(x, mask, None))
    assert_close(masked_mean(dirty, mask, dim=1), ref_mean(x, mask, 1))
    assert torch.isfinite(masked_var(dirty, mask))
    assert torch.isfinite(masked_whiten(dirty, mask)).all()


def test_masked_mean_gradient_is_zero_at_padding_even_with_inf_there() -> None:
    x, mask = batch(pad=float("inf"))
    x.requires_grad_(True)
    masked_mean(x, mask).backward()
    assert x.grad is not None
    assert (x.grad[~mask] == 0).all()
    n = int(mask.sum())
    assert_close(x.grad[mask], torch.full((n,), 1.0 / n, dtype=torch.float64))


def test_masked_mean_accepts_a_zero_one_integer_mask() -> None:
    x, mask = batch()
    assert_close(masked_mean(x, mask.long(), dim=1), ref_mean(x, mask, 1))
    assert_close(masked_mean(x, mask.float()), ref_mean(x, mask, None))


def test_masked_mean_keeps_bf16_dtype_but_accumulates_in_float32() -> None:
    # 4096 values near 256: a bf16 running sum would stall once it reaches 2**16 and more.
    x = (256 + torch.arange(4096, dtype=torch.float64) % 7).reshape(64, 64)
    mask = torch.ones(x.shape, dtype=torch.bool)
    out = masked_mean(x.to(torch.bfloat16), mask)
    assert out.dtype == torch.bfloat16
    assert_close(out.double(), x.to(torch.bfloat16).double().mean(), rtol=4e-3, atol=0.0)


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_loop_reference(unbiased: bool) -> None:
    x, mask = batch(seed=3)
    expected = ref_var([v for _, _, v in cells(x, mask)], unbiased)
    assert_close(masked_var(x, mask, unbiased=unbiased), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_is_zero_with_fewer_than_two_elements(unbiased: bool) -> None:
    x, _ = batch()
    one = lengths_mask([0, 0, 0, 1, 0])  # only the single-token row
    assert masked_var(x, one, unbiased=unbiased).item() == 0.0
    assert masked_var(x, torch.zeros_like(one), unbiased=unbiased).item() == 0.0


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop_reference_and_zeroes_padding(shift_mean: bool) -> None:
    x, mask = batch(seed=5)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    assert_close(out, ref_whiten(x, mask, shift_mean, 1e-8))
    assert (out[~mask] == 0).all()


def test_masked_whiten_of_single_element_is_zero_or_the_element_itself() -> None:
    x, _ = batch()
    one = lengths_mask([0, 0, 0, 1, 0])
    assert masked_whiten(x, one)[3, 0].item() == 0.0
    assert_close(masked_whiten(x, one, shift_mean=False)[3, 0], x[3, 0])


@st.composite
def masked_batches(draw: st.DrawFn, min_real: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 5))
    r = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(0, r), min_size=b, max_size=b))
    if sum(lengths) < min_real:
        lengths[0] = r
    vals = draw(st.lists(st.floats(-100, 100, allow_nan=False, width=64), min_size=b * r, max_size=b * r))
    return torch.tensor(vals, dtype=torch.float64).reshape(b, r), lengths_mask(lengths, r)


@settings(max_examples=60, deadline=None)
@given(masked_batches(min_real=2))
def test_masked_whiten_gives_mean_zero_and_unit_variance_on_masked_positions(
    data: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, mask = data
    if ref_var([v for _, _, v in cells(x, mask)], unbiased=True) < 1e-2:
        return  # (near-)constant input: whitening maps it to ~0, variance is not defined as 1
    out = masked_whiten(x, mask)
    real = out[mask]
    assert abs(real.mean().item()) < 1e-6
    assert abs(real.var(unbiased=True).item() - 1.0) < 1e-4
    assert (out[~mask] == 0).all()


@settings(max_examples=60, deadline=None)
@given(masked_batches())
def test_masked_mean_never_returns_nan(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, mask = data
    for dim in (None, 0, 1):
        out = masked_mean(x, mask, dim=dim)
        assert torch.isfinite(out).all()
        assert_close(out, ref_mean(x, mask, dim))


# ---- numpy: the same functions on the controller's arrays --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_reduction_gives_numpy_arrays_what_it_gives_tensors(dtype: torch.dtype) -> None:
    """One implementation for both backends: the controller's statistics (numpy) and the trainer's
    losses (torch) reduce alike, in the input's dtype, padding garbage (inf included) ignored."""
    import numpy as np

    from services.rl.kl import KL_KINDS, kl_estimate

    x, mask = batch(3, pad=float("inf"))
    x = x.to(dtype)
    ref = torch.where(mask, x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=dtype),
                      torch.full_like(x, -float("inf")))
    xn, mn, rn = x.numpy(), mask.numpy(), ref.numpy()
    pairs = [(masked_sum(x, mask, dim=d), masked_sum(xn, mn, dim=d)) for d in (None, 0, 1)]
    pairs += [(masked_mean(x, mask, dim=d), masked_mean(xn, mn, dim=d)) for d in (None, 0, 1)]
    pairs += [(masked_var(x, mask), masked_var(xn, mn)), (masked_whiten(x, mask), masked_whiten(xn, mn)),
              (masked_whiten(x, mask, shift_mean=False), masked_whiten(xn, mn, shift_mean=False))]
    pairs += [(kl_estimate(x, ref, kind), kl_estimate(xn, rn, kind)) for kind in KL_KINDS]  # type: ignore[arg-type]
    for want, got in pairs:
        assert isinstance(got, np.ndarray) and got.dtype == want.numpy().dtype
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-6)
    assert masked_mean(xn, np.zeros_like(mn)) == 0 and masked_var(xn[:1, :1], mn[:1, :1]) == 0
