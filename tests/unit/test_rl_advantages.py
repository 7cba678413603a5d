"""Advantage estimators (numpy: the controller computes them without torch): checked against float64
loop references, padding garbage included."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rl.advantages import (
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)

R = 6
# A full row, a padded row, an empty row, a single-token row, another padded row.
LENGTHS = [6, 3, 0, 1, 4]
GARBAGE = 1e6
Array = np.ndarray[Any, Any]


def assert_close(actual: Array, expected: Array) -> None:
    """Same shape and dtype, and close (float64: 1e-7 relative; float32: 1.3e-6), as torch's assert_close."""
    assert isinstance(actual, np.ndarray) and actual.shape == expected.shape and actual.dtype == expected.dtype
    rtol, atol = (1e-7, 1e-7) if actual.dtype == np.float64 else (1.3e-6, 1e-5)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def t(values: Any, dtype: Any = np.float32) -> Array:
    return np.asarray(values, dtype=dtype)


def lengths_mask(lengths: list[int], width: int = R) -> Array:
    return np.array([[t < n for t in range(width)] for n in lengths], dtype=bool).reshape(len(lengths), width)


def randn(shape: tuple[int, ...], seed: int) -> Array:
    return np.random.default_rng(seed).standard_normal(shape)


def dirty(x: Array, mask: Array, value: float = GARBAGE) -> Array:
    """x with arbitrary values at padding: every function must ignore them."""
    return np.where(mask, x, np.full_like(x, value))


def real_steps(mask: Array, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


# ---- references -----------------------------------------------------------------------------


def ref_token_rewards(
    scores: list[float], mask: Array, kl: Array | None, coef: float
) -> Array:
    out = np.zeros(mask.shape, dtype=np.float64)
    for i, score in enumerate(scores):
        steps = real_steps(mask, i)
        for t in steps:
            out[i, t] = -coef * float(kl[i, t]) if kl is not None else 0.0
        if steps:
            out[i, steps[-1]] += score
    return out


def ref_gae(
    rew: Array, val: Array, mask: Array, gamma: float, lam: float
) -> tuple[Array, Array]:
    adv = np.zeros(mask.shape, dtype=np.float64)
    ret = np.zeros(mask.shape, dtype=np.float64)
    for i in range(mask.shape[0]):
        steps = real_steps(mask, i)
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_v = float(val[i, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(rew[i, t]) + gamma * next_v - float(val[i, t])
            running = delta + gamma * lam * running
            adv[i, t] = running
            ret[i, t] = running + float(val[i, t])
    return adv, ret


def ref_group_stats(scores: list[float], groups: list[int]) -> dict[int, list[float]]:
    members: dict[int, list[float]] = {}
    for s, g in zip(scores, groups, strict=True):
        members.setdefault(g, []).append(s)
    return members


def ref_grpo(
    scores: list[float], groups: list[int], mask: Array, norm_std: bool, eps: float
) -> Array:
    members = ref_group_stats(scores, groups)
    out = np.zeros(mask.shape, dtype=np.float64)
    for i, (s, g) in enumerate(zip(scores, groups, strict=True)):
        vals = members[g]
        n = len(vals)
        if n < 2:
            continue
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        a = (s - mean) / (std + eps) if norm_std else s - mean
        for t in real_steps(mask, i):
            out[i, t] = a
    return out


def ref_rloo(scores: list[float], groups: list[int], mask: Array) -> Array:
    out = np.zeros(mask.shape, dtype=np.float64)
    for i, (s, g) in enumerate(zip(scores, groups, strict=True)):
        others = [scores[j] for j in range(len(scores)) if j != i and groups[j] == g]
        if not others:
            continue
        for t in real_steps(mask, i):
            out[i, t] = s - sum(others) / len(others)
    return out


def ref_reinforce_pp(rew: Array, mask: Array, gamma: float) -> Array:
    rtg = np.zeros(mask.shape, dtype=np.float64)
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(real_steps(mask, i)):
            running = float(rew[i, t]) + gamma * running
            rtg[i, t] = running
    vals = [float(rtg[i, t]) for i in range(mask.shape[0]) for t in real_steps(mask, i)]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n >= 2 else 0.0
    out = np.zeros(mask.shape, dtype=np.float64)
    for i in range(mask.shape[0]):
        for t in real_steps(mask, i):
            out[i, t] = (float(rtg[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


# ---- token_level_rewards --------------------------------------------------------------------

SCORES = [1.0, -2.0, 3.0, 0.5, 4.0]


def test_token_level_rewards_puts_score_on_last_real_token_only() -> None:
    mask = lengths_mask(LENGTHS)
    out = token_level_rewards(t(SCORES, np.float64), mask)
    assert_close(out, ref_token_rewards(SCORES, mask, None, 0.0))
    assert out[0, 5].item() == 1.0 and out[1, 2].item() == -2.0 and out[3, 0].item() == 0.5
    assert (out[2] == 0).all()  # empty row: its score has nowhere to go


def test_token_level_rewards_subtracts_kl_on_every_real_token_and_ignores_padding() -> None:
    mask = lengths_mask(LENGTHS)
    kl = np.abs(randn(mask.shape, 1))
    out = token_level_rewards(
        t(SCORES, np.float64), mask, kl=dirty(kl, mask, float("inf")), kl_coef=0.1
    )
    assert_close(out, ref_token_rewards(SCORES, mask, kl, 0.1))
    assert (out[~mask] == 0).all()


def test_token_level_rewards_uses_last_true_when_mask_has_a_hole() -> None:
    mask = t([[True, False, True, False], [False, True, True, False]], bool)
    out = token_level_rewards(t([1.0, 2.0]), mask)
    assert_close(out, ref_token_rewards([1.0, 2.0], mask, None, 0.0).astype(np.float32))


def test_token_level_rewards_of_fully_empty_mask_are_zero() -> None:
    mask = np.zeros((3, 4), dtype=bool)
    ones = np.ones(3, dtype=np.float32)
    assert (token_level_rewards(ones, mask, kl=np.ones((3, 4), dtype=np.float32), kl_coef=0.5) == 0).all()
    assert token_level_rewards(np.ones(3, dtype=np.float32), np.zeros((3, 0), dtype=bool)).shape == (3, 0)


# ---- gae ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.0, 0.5)])
def test_gae_matches_loop_reference(gamma: float, lam: float) -> None:
    mask = lengths_mask(LENGTHS)
    rew, val = randn(mask.shape, 2), randn(mask.shape, 3)
    adv, ret = gae(dirty(rew, mask), dirty(val, mask), mask, gamma, lam)
    exp_adv, exp_ret = ref_gae(rew, val, mask, gamma, lam)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)


def test_gae_ignores_padding_after_last_token() -> None:
    mask = lengths_mask(LENGTHS)
    rew, val = randn(mask.shape, 4), randn(mask.shape, 5)
    a1, r1 = gae(dirty(rew, mask, 0.0), dirty(val, mask, 0.0), mask, 0.99, 0.95)
    a2, r2 = gae(dirty(rew, mask, -7e5), dirty(val, mask, float("inf")), mask, 0.99, 0.95)
    assert_close(a1, a2)
    assert_close(r1, r2)
    assert (a1[~mask] == 0).all() and (r1[~mask] == 0).all()


def test_gae_bootstraps_zero_value_after_the_last_real_token() -> None:
    mask = lengths_mask([3], width=5)
    rew = t([[0.0, 0.0, 1.0, 9.0, 9.0]], np.float64)
    val = t([[0.5, 0.5, 0.5, 9.0, 9.0]], np.float64)
    adv, _ = gae(rew, val, mask, 1.0, 1.0)
    # gamma = lam = 1: advantage is return-to-go (1.0) minus the value.
    assert_close(adv, t([[0.5, 0.5, 0.5, 0.0, 0.0]], np.float64))


def test_gae_skips_holes_in_the_mask_as_if_real_tokens_were_consecutive() -> None:
    mask = t([[True, False, True, True, False, False], [False, True, False, True, False, True]], bool)
    rew, val = randn(mask.shape, 6), randn(mask.shape, 7)
    adv, ret = gae(dirty(rew, mask), dirty(val, mask), mask, 0.9, 0.7)
    exp_adv, exp_ret = ref_gae(rew, val, mask, 0.9, 0.7)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)


def test_gae_of_single_token_response_is_reward_minus_value() -> None:
    mask = lengths_mask([1, 0], width=3)
    rew = t([[2.0, 5.0, 5.0], [1.0, 1.0, 1.0]])
    val = t([[0.5, 5.0, 5.0], [1.0, 1.0, 1.0]])
    adv, ret = gae(rew, val, mask, 0.99, 0.95)
    assert_close(adv, t([[1.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(ret, t([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_of_fully_empty_mask_is_zero() -> None:
    mask = np.zeros((2, 4), dtype=bool)
    adv, ret = gae(np.ones((2, 4), dtype=np.float32), np.ones((2, 4), dtype=np.float32), mask, 1.0, 0.95)
    assert (adv == 0).all() and (ret == 0).all()
    assert adv.dtype == np.float32


# ---- grpo / rloo ----------------------------------------------------------------------------

# Groups: 7 (3 members), 3 (2 members), 9 (1 member); the 7-group includes the empty row.
GROUPS = [7, 3, 7, 9, 7, 3]
GROUP_SCORES = [1.0, 0.0, 3.0, 5.0, -1.0, 2.0]
GROUP_LENGTHS = [6, 3, 0, 1, 4, 2]


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_advantages_match_loop_reference(norm_std: bool) -> None:
    mask = lengths_mask(GROUP_LENGTHS)
    out = grpo_advantages(
        t(GROUP_SCORES, np.float64), t(GROUPS, np.int64), mask, norm_std=norm_std
    )
    assert_close(out, ref_grpo(GROUP_SCORES, GROUPS, mask, norm_std, 1e-6))


def test_grpo_gives_zero_advantage_to_a_group_of_one() -> None:
    mask = lengths_mask(GROUP_LENGTHS)
    out = grpo_advantages(t(GROUP_SCORES), t(GROUPS, np.int64), mask)
    assert (out[3] == 0).all()
    assert np.isfinite(out).all()


def test_grpo_gives_zero_advantage_when_a_group_ties() -> None:
    mask = lengths_mask([3, 3, 3, 3])
    out = grpo_advantages(t([1.0, 1.0, 0.0, 2.0]), t([0, 0, 1, 1], np.int64), mask)
    assert (out[:2] == 0).all()
    assert out[2, 0].item() < 0 < out[3, 0].item()


def test_grpo_of_fully_empty_mask_is_zero() -> None:
    out = grpo_advantages(t([1.0, 2.0]), t([0, 0], np.int64), np.zeros((2, 3), dtype=bool))
    assert (out == 0).all()


def test_rloo_advantages_match_loop_reference() -> None:
    mask = lengths_mask(GROUP_LENGTHS)
    out = rloo_advantages(t(GROUP_SCORES, np.float64), t(GROUPS, np.int64), mask)
    assert_close(out, ref_rloo(GROUP_SCORES, GROUPS, mask))
    assert (out[3] == 0).all()  # singleton group


def test_rloo_is_grpo_without_std_scaled_by_n_over_n_minus_one() -> None:
    mask = lengths_mask([2, 2, 2, 2, 2])
    scores = t([0.3, 1.2, -0.7, 2.0, 0.1], np.float64)
    groups = np.zeros(5, dtype=np.int64)
    assert_close(
        rloo_advantages(scores, groups, mask), grpo_advantages(scores, groups, mask, norm_std=False) * 5 / 4
    )


@st.composite
def grouped(draw: st.DrawFn) -> tuple[Array, Array, Array]:
    b = draw(st.integers(1, 12))
    groups = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    scores = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=64), min_size=b, max_size=b))
    lengths = draw(st.lists(st.integers(1, 4), min_size=b, max_size=b))
    return t(scores, np.float64), t(groups, np.int64), lengths_mask(lengths, 4)


@settings(max_examples=60, deadline=None)
@given(grouped())
def test_grpo_advantages_sum_to_zero_within_each_group(
    data: tuple[Array, Array, Array],
) -> None:
    scores, groups, mask = data
    per_row = grpo_advantages(scores, groups, mask)[:, 0]  # every row has >= 1 token
    for g in np.unique(groups):
        assert abs(per_row[groups == g].sum().item()) < 1e-6
    assert_close(
        grpo_advantages(scores, groups, mask), ref_grpo(scores.tolist(), groups.tolist(), mask, True, 1e-6)
    )


@settings(max_examples=60, deadline=None)
@given(grouped())
def test_rloo_advantages_sum_to_zero_within_each_group(
    data: tuple[Array, Array, Array],
) -> None:
    scores, groups, mask = data
    per_row = rloo_advantages(scores, groups, mask)[:, 0]
    for g in np.unique(groups):
        assert abs(per_row[groups == g].sum().item()) < 1e-9
    assert_close(rloo_advantages(scores, groups, mask), ref_rloo(scores.tolist(), groups.tolist(), mask))


# ---- reinforce++ ----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop_reference_and_ignores_padding(gamma: float) -> None:
    mask = lengths_mask(LENGTHS)
    rew = randn(mask.shape, 8)
    out = reinforce_pp_advantages(dirty(rew, mask), mask, gamma)
    assert_close(out, ref_reinforce_pp(rew, mask, gamma))
    assert (out[~mask] == 0).all()


def test_reinforce_pp_is_whitened_over_all_masked_tokens() -> None:
    mask = lengths_mask(LENGTHS)
    out = reinforce_pp_advantages(randn(mask.shape, 9), mask, 1.0)
    assert abs(out[mask].mean().item()) < 1e-9
    assert abs(out[mask].var(ddof=1).item() - 1.0) < 1e-6


def test_reinforce_pp_of_fully_empty_mask_and_single_token_are_zero() -> None:
    assert (reinforce_pp_advantages(np.ones((2, 3), dtype=np.float32), np.zeros((2, 3), dtype=bool), 1.0) == 0).all()
    one = lengths_mask([1, 0], width=3)
    # one token: nothing to whiten
    assert (reinforce_pp_advantages(np.ones((2, 3), dtype=np.float32), one, 1.0) == 0).all()
