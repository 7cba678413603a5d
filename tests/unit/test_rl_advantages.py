"""Advantage estimators: checked against float64 loop references, padding garbage included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

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


def lengths_mask(lengths: list[int], width: int = R) -> torch.Tensor:
    return torch.tensor([[t < n for t in range(width)] for n in lengths])


def randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def dirty(x: torch.Tensor, mask: torch.Tensor, value: float = GARBAGE) -> torch.Tensor:
    """x with arbitrary values at padding: every function must ignore them."""
    return torch.where(mask, x, torch.full_like(x, value))


def real_steps(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


# ---- references -----------------------------------------------------------------------------


def ref_token_rewards(
    scores: list[float], mask: torch.Tensor, kl: torch.Tensor | None, coef: float
) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, score in enumerate(scores):
        steps = real_steps(mask, i)
        for t in steps:
            out[i, t] = -coef * float(kl[i, t]) if kl is not None else 0.0
        if steps:
            out[i, steps[-1]] += score
    return out


def ref_gae(
    rew: torch.Tensor, val: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
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
    scores: list[float], groups: list[int], mask: torch.Tensor, norm_std: bool, eps: float
) -> torch.Tensor:
    members = ref_group_stats(scores, groups)
    out = torch.zeros(mask.shape, dtype=torch.float64)
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


def ref_rloo(scores: list[float], groups: list[int], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, (s, g) in enumerate(zip(scores, groups, strict=True)):
        others = [scores[j] for j in range(len(scores)) if j != i and groups[j] == g]
        if not others:
            continue
        for t in real_steps(mask, i):
            out[i, t] = s - sum(others) / len(others)
    return out


def ref_reinforce_pp(rew: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    rtg = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(real_steps(mask, i)):
            running = float(rew[i, t]) + gamma * running
            rtg[i, t] = running
    vals = [float(rtg[i, t]) for i in range(mask.shape[0]) for t in real_steps(mask, i)]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n >= 2 else 0.0
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in real_steps(mask, i):
            out[i, t] = (float(rtg[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


# ---- token_level_rewards --------------------------------------------------------------------

SCORES = [1.0, -2.0, 3.0, 0.5, 4.0]


def test_token_level_rewards_puts_score_on_last_real_token_only() -> None:
    mask = lengths_mask(LENGTHS)
    out = token_level_rewards(torch.tensor(SCORES, dtype=torch.float64), mask)
    assert_close(out, ref_token_rewards(SCORES, mask, None, 0.0))
    assert out[0, 5].item() == 1.0 and out[1, 2].item() == -2.0 and out[3, 0].item() == 0.5
    assert (out[2] == 0).all()  # empty row: its score has nowhere to go


def test_token_level_rewards_subtracts_kl_on_every_real_token_and_ignores_padding() -> None:
    mask = lengths_mask(LENGTHS)
    kl = randn(mask.shape, 1).abs()
    out = token_level_rewards(
        torch.tensor(SCORES, dtype=torch.float64), mask, kl=dirty(kl, mask, float("inf")), kl_coef=0.1
    )
    assert_close(out, ref_token_rewards(SCORES, mask, kl, 0.1))
    assert (out[~mask] == 0).all()


def test_token_level_rewards_uses_last_true_when_mask_has_a_hole() -> None:
    mask = torch.tensor([[True, False, True, False], [False, True, True, False]])
    out = token_level_rewards(torch.tensor([1.0, 2.0]), mask)
    assert_close(out, ref_token_rewards([1.0, 2.0], mask, None, 0.0).float())


def test_token_level_rewards_of_fully_empty_mask_are_zero() -> None:
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert (token_level_rewards(torch.ones(3), mask, kl=torch.ones(3, 4), kl_coef=0.5) == 0).all()
    assert token_level_rewards(torch.ones(3), torch.zeros(3, 0, dtype=torch.bool)).shape == (3, 0)


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
    rew = torch.tensor([[0.0, 0.0, 1.0, 9.0, 9.0]], dtype=torch.float64)
    val = torch.tensor([[0.5, 0.5, 0.5, 9.0, 9.0]], dtype=torch.float64)
    adv, _ = gae(rew, val, mask, 1.0, 1.0)
    # gamma = lam = 1: advantage is return-to-go (1.0) minus the value.
    assert_close(adv, torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.0]], dtype=torch.float64))


def test_gae_skips_holes_in_the_mask_as_if_real_tokens_were_consecutive() -> None:
    mask = torch.tensor([[True, False, True, True, False, False], [False, True, False, True, False, True]])
    rew, val = randn(mask.shape, 6), randn(mask.shape, 7)
    adv, ret = gae(dirty(rew, mask), dirty(val, mask), mask, 0.9, 0.7)
    exp_adv, exp_ret = ref_gae(rew, val, mask, 0.9, 0.7)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)


def test_gae_of_single_token_response_is_reward_minus_value() -> None:
    mask = lengths_mask([1, 0], width=3)
    rew = torch.tensor([[2.0, 5.0, 5.0], [1.0, 1.0, 1.0]])
    val = torch.tensor([[0.5, 5.0, 5.0], [1.0, 1.0, 1.0]])
    adv, ret = gae(rew, val, mask, 0.99, 0.95)
    assert_close(adv, torch.tensor([[1.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(ret, torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_of_fully_empty_mask_is_zero() -> None:
    mask = torch.zeros(2, 4, dtype=torch.bool)
    adv, ret = gae(torch.ones(2, 4), torch.ones(2, 4), mask, 1.0, 0.95)
    assert (adv == 0).all() and (ret == 0).all()
    assert adv.dtype == torch.float32


# ---- grpo / rloo ----------------------------------------------------------------------------

# Groups: 7 (3 members), 3 (2 members), 9 (1 member); the 7-group includes the empty row.
GROUPS = [7, 3, 7, 9, 7, 3]
GROUP_SCORES = [1.0, 0.0, 3.0, 5.0, -1.0, 2.0]
GROUP_LENGTHS = [6, 3, 0, 1, 4, 2]


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_advantages_match_loop_reference(norm_std: bool) -> None:
    mask = lengths_mask(GROUP_LENGTHS)
    out = grpo_advantages(
        torch.tensor(GROUP_SCORES, dtype=torch.float64), torch.tensor(GROUPS), mask, norm_std=norm_std
    )
    assert_close(out, ref_grpo(GROUP_SCORES, GROUPS, mask, norm_std, 1e-6))


def test_grpo_gives_zero_advantage_to_a_group_of_one() -> None:
    mask = lengths_mask(GROUP_LENGTHS)
    out = grpo_advantages(torch.tensor(GROUP_SCORES), torch.tensor(GROUPS), mask)
    assert (out[3] == 0).all()
    assert torch.isfinite(out).all()


def test_grpo_gives_zero_advantage_when_a_group_ties() -> None:
    mask = lengths_mask([3, 3, 3, 3])
    out = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), torch.tensor([0, 0, 1, 1]), mask)
    assert (out[:2] == 0).all()
    assert out[2, 0].item() < 0 < out[3, 0].item()


def test_grpo_of_fully_empty_mask_is_zero() -> None:
    out = grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.zeros(2, 3, dtype=torch.bool))
    assert (out == 0).all()


def test_rloo_advantages_match_loop_reference() -> None:
    mask = lengths_mask(GROUP_LENGTHS)
    out = rloo_advantages(torch.tensor(GROUP_SCORES, dtype=torch.float64), torch.tensor(GROUPS), mask)
    assert_close(out, ref_rloo(GROUP_SCORES, GROUPS, mask))
    assert (out[3] == 0).all()  # singleton group


def test_rloo_is_grpo_without_std_scaled_by_n_over_n_minus_one() -> None:
    mask = lengths_mask([2, 2, 2, 2, 2])
    scores = torch.tensor([0.3, 1.2, -0.7, 2.0, 0.1], dtype=torch.float64)
    groups = torch.zeros(5, dtype=torch.long)
    assert_close(
        rloo_advantages(scores, groups, mask), grpo_advantages(scores, groups, mask, norm_std=False) * 5 / 4
    )


@st.composite
def grouped(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 12))
    groups = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    scores = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=64), min_size=b, max_size=b))
    lengths = draw(st.lists(st.integers(1, 4), min_size=b, max_size=b))
    return torch.tensor(scores, dtype=torch.float64), torch.tensor(groups), lengths_mask(lengths, 4)


@settings(max_examples=60, deadline=None)
@given(grouped())
def test_grpo_advantages_sum_to_zero_within_each_group(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    scores, groups, mask = data
    per_row = grpo_advantages(scores, groups, mask)[:, 0]  # every row has >= 1 token
    for g in groups.unique():
        assert abs(per_row[groups == g].sum().item()) < 1e-6
    assert_close(
        grpo_advantages(scores, groups, mask), ref_grpo(scores.tolist(), groups.tolist(), mask, True, 1e-6)
    )


@settings(max_examples=60, deadline=None)
@given(grouped())
def test_rloo_advantages_sum_to_zero_within_each_group(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    scores, groups, mask = data
    per_row = rloo_advantages(scores, groups, mask)[:, 0]
    for g in groups.unique():
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
    assert abs(out[mask].var(unbiased=True).item() - 1.0) < 1e-6


def test_reinforce_pp_of_fully_empty_mask_and_single_token_are_zero() -> None:
    assert (reinforce_pp_advantages(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), 1.0) == 0).all()
    one = lengths_mask([1, 0], width=3)
    assert (reinforce_pp_advantages(torch.ones(2, 3), one, 1.0) == 0).all()  # one token: nothing to whiten
