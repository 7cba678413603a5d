"""Losses and KL estimators: checked against float64 loop references (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from services.rl.kl import KLKind, kl_estimate
from services.rl.losses import (
    AggMode,
    aggregate,
    behaviour_weights,
    entropy_from_logits,
    kl_loss,
    policy_loss,
    value_loss,
)

R = 6
# A full row, a padded row, an empty row, a single-token row, another padded row.
LENGTHS = [6, 3, 0, 1, 4]
AGGS: list[AggMode] = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KINDS: list[KLKind] = ["k1", "k2", "k3"]
GARBAGE = 1e4


def lengths_mask(lengths: list[int], width: int = R) -> torch.Tensor:
    return torch.tensor([[t < n for t in range(width)] for n in lengths])


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def dirty(x: torch.Tensor, mask: torch.Tensor, value: float = GARBAGE) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def real_cells(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if bool(mask[i, t])]


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def ref_aggregate(per_token: dict[tuple[int, int], torch.Tensor], rows: int, mode: str) -> torch.Tensor:
    """Aggregate a dict of scalar (autograd) tensors, one per real token, with plain loops."""
    zero = torch.zeros((), dtype=torch.float64)
    if mode == "token_mean":
        vals = list(per_token.values())
        return sum(vals, zero) / len(vals) if vals else zero
    row_vals: list[torch.Tensor] = []
    for i in range(rows):
        toks = [v for (j, _), v in per_token.items() if j == i]
        if toks:
            s = sum(toks, zero)
            row_vals.append(s / len(toks) if mode == "seq_mean_token_mean" else s)
    return sum(row_vals, zero) / len(row_vals) if row_vals else zero


def ref_kl(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    lr = min(max(-d, -20.0), 20.0)
    return math.exp(lr) - lr - 1.0


# ---- kl_estimate ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_kl_estimate_matches_schulman_formulas(kind: KLKind) -> None:
    lp, ref = randn((3, 4), 1), randn((3, 4), 2)
    expected = torch.tensor(
        [[ref_kl(float(lp[i, t]), float(ref[i, t]), kind) for t in range(4)] for i in range(3)],
        dtype=torch.float64,
    )
    assert_close(kl_estimate(lp, ref, kind), expected)


def test_kl_estimate_k3_stays_finite_for_extreme_log_ratios_even_unbounded() -> None:
    lp = torch.tensor([[0.0, -500.0, 0.0]])
    ref = torch.tensor([[-500.0, 0.0, 0.0]])
    out = kl_estimate(lp, ref, "k3", clamp=None)
    assert torch.isfinite(out).all()
    assert_close(out[0, 1], torch.tensor(math.exp(20.0) - 21.0))  # clamped at +20
    assert_close(out[0, 0], torch.tensor(math.exp(-20.0) + 19.0))  # clamped at -20
    assert out[0, 2].item() == 0.0


def test_kl_estimate_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30, 30, allow_nan=False, width=64), min_size=2, max_size=16))
def test_kl_estimate_k2_and_k3_are_never_negative(vals: list[float]) -> None:
    x = torch.tensor(vals, dtype=torch.float64).reshape(1, -1)
    y = x.flip(1)
    assert (kl_estimate(x, y, "k3") >= 0).all()
    assert (kl_estimate(x, y, "k2") >= 0).all()


# ---- aggregate ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGGS)
def test_aggregate_matches_loop_reference_and_skips_empty_rows(mode: AggMode) -> None:
    mask = lengths_mask(LENGTHS)
    x = leaf(dirty(randn(mask.shape, 3), mask))
    xr = leaf(x)
    out = aggregate(x, mask, mode)
    expected = ref_aggregate({c: xr[c] for c in real_cells(mask)}, mask.shape[0], mode)
    assert_close(out, expected)
    out.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("mode", AGGS)
def test_aggregate_of_fully_empty_mask_is_zero_and_keeps_the_graph(mode: AggMode) -> None:
    x = leaf(randn((3, 4), 4))
    out = aggregate(x, torch.zeros(3, 4, dtype=torch.bool), mode)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert x.grad is not None and (x.grad == 0).all()


def test_aggregate_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="sum"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "sum")  # type: ignore[arg-type]


# ---- behaviour_weights ----------------------------------------------------------------------


def ref_weights(prox: torch.Tensor, beh: torch.Tensor, mask: torch.Tensor, mode: str, cap: float | None,
                floor: float | None) -> torch.Tensor:
    """The weight of every real token, one cell at a time (the modes' definitions, as TRL's docs state them)."""
    lo, hi = -math.inf if floor is None else floor, math.inf if cap is None else cap
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, t in real_cells(mask):
        if mode.startswith("sequence"):
            ratio = math.exp(sum(float(prox[i, u]) - float(beh[i, u]) for u in range(mask.shape[1]) if mask[i, u]))
        else:
            ratio = math.exp(float(prox[i, t]) - float(beh[i, t]))
        if mode == "none":
            out[i, t] = 1.0
        elif mode.endswith("truncate"):
            out[i, t] = min(max(ratio, lo), hi)
        else:
            out[i, t] = ratio if lo <= ratio <= hi else 0.0
    return out


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"])
@pytest.mark.parametrize(("floor", "cap"), [(None, 1.5), (0.5, 1.5), (0.7, None), (None, None)])
def test_behaviour_weights_follow_each_modes_definition_zero_on_padding_and_detached(
    mode: str, floor: float | None, cap: float | None
) -> None:
    mask = lengths_mask(LENGTHS)
    prox_data = dirty(randn(mask.shape, 5, scale=0.4), mask)
    prox = leaf(prox_data)
    beh = dirty(randn(mask.shape, 6, scale=0.4), mask, -GARBAGE)
    w, stats = behaviour_weights(prox, beh, mask, mode, cap, floor)  # type: ignore[arg-type]
    expected = ref_weights(prox_data, beh, mask, mode, cap, floor)
    assert_close(w, expected)
    assert not w.requires_grad
    real = [expected[i, t] for i, t in real_cells(mask)]
    assert stats["behaviour_weight_mean"].item() == pytest.approx(sum(real) / len(real))
    assert stats["behaviour_weight_max"].item() == pytest.approx(max(real))
    logs = [float(prox_data[i, t]) - float(beh[i, t]) for i, t in real_cells(mask)]
    assert stats["behaviour_log_ratio_mean"].item() == pytest.approx(sum(logs) / len(logs))
    assert stats["behaviour_log_ratio_abs_max"].item() == pytest.approx(max(abs(x) for x in logs))
    # The share of tokens a bound changed: the cells where the mode's weight is not its ratio.
    unbounded = ref_weights(prox_data, beh, mask, mode.replace("mask", "truncate"), None, None)
    moved = [float(expected[i, t] != unbounded[i, t]) for i, t in real_cells(mask)]
    assert stats["behaviour_bounded_frac"].item() == pytest.approx(0.0 if mode == "none" else sum(moved) / len(moved))


def test_a_sequence_mask_drops_a_whole_response_whose_product_of_ratios_passes_the_cap() -> None:
    mask = lengths_mask([3, 3], width=3)
    beh = torch.zeros(2, 3, dtype=torch.float64)
    # Row 0: each token only 1.5x likelier under the trainer, but 1.5^3 = 3.375 > 3 for the response.
    prox = torch.tensor([[math.log(1.5)] * 3, [math.log(1.2), 0.0, math.log(0.9)]], dtype=torch.float64)
    w, stats = behaviour_weights(prox, beh, mask, "sequence_mask", cap=3.0)
    assert_close(w[0], torch.zeros(3, dtype=torch.float64))
    assert_close(w[1], torch.full((3,), 1.2 * 0.9, dtype=torch.float64))
    assert stats["behaviour_bounded_frac"].item() == pytest.approx(0.5)
    assert stats["behaviour_ratio_max"].item() == pytest.approx(1.5**3)
    # Per token, the same response is inside the cap.
    assert behaviour_weights(prox, beh, mask, "token_mask", cap=3.0)[0][0].tolist() == pytest.approx([1.5] * 3)


def test_behaviour_weights_refuse_an_unknown_mode_and_a_floor_above_the_cap() -> None:
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown behaviour correction 'tis'"):
        behaviour_weights(x, x, mask, "tis", cap=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"floor 2\.0 must be below its cap 1\.5"):
        behaviour_weights(x, x, mask, "token_mask", cap=1.5, floor=2.0)


# ---- policy_loss ----------------------------------------------------------------------------


def ref_policy(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps: float,
    eps_high: float | None,
    agg: AggMode,
    beh: torch.Tensor | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    hi = eps if eps_high is None else eps_high
    per_token: dict[tuple[int, int], torch.Tensor] = {}
    clipped, kls, ratios, weights = [], [], [], []
    for i, t in real_cells(mask):
        ratio = torch.exp(logp[i, t] - float(old[i, t]))
        a = float(adv[i, t])
        loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + hi) * a)
        w = 1.0
        if beh is not None:
            w = math.exp(float(old[i, t]) - float(beh[i, t]))
            w = w if cap is None else min(w, cap)
        per_token[(i, t)] = loss * w
        r = float(ratio.detach())
        clipped.append(float((r > 1 + hi and a > 0) or (r < 1 - eps and a < 0)))
        kls.append(r - 1 - math.log(r))
        ratios.append(r)
        weights.append(w)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    stats = {
        "clip_frac": mean(clipped),
        "approx_kl": mean(kls),
        "ratio_mean": mean(ratios),
        "behaviour_weight_mean": mean(weights) if beh is not None else 1.0,
    }
    return ref_aggregate(per_token, mask.shape[0], agg), stats


def policy_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = lengths_mask(LENGTHS)
    old = -randn(mask.shape, seed).abs() - 0.1
    logp = old + randn(mask.shape, seed + 1, scale=0.5)  # ratios on both sides of the clip range
    adv = randn(mask.shape, seed + 2)
    return logp, old, adv, mask


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_policy_loss_matches_loop_reference_in_value_grad_and_stats(
    agg: AggMode, eps_high: float | None
) -> None:
    logp, old, adv, mask = policy_inputs(10)
    x, xr = leaf(dirty(logp, mask)), leaf(logp)
    loss, stats = policy_loss(x, dirty(old, mask, -GARBAGE), dirty(adv, mask), mask, 0.2, eps_high, agg)
    expected, exp_stats = ref_policy(xr, old, adv, mask, 0.2, eps_high, agg)
    assert_close(loss, expected)
    assert stats == pytest.approx(exp_stats, rel=1e-9, abs=1e-12)
    assert 0 < stats["clip_frac"] < 1  # the inputs exercise both branches
    loss.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("agg", AGGS)
def test_policy_loss_decoupled_weights_tokens_by_capped_behaviour_ratio(agg: AggMode) -> None:
    logp, old, adv, mask = policy_inputs(20)
    beh = old + randn(mask.shape, 23, scale=0.8)
    x, xr = leaf(logp), leaf(logp)
    loss, stats = policy_loss(x, old, adv, mask, 0.2, None, agg, beh, 1.5)
    expected, exp_stats = ref_policy(xr, old, adv, mask, 0.2, None, agg, beh, 1.5)
    assert_close(loss, expected)
    assert {k: stats[k] for k in exp_stats} == pytest.approx(exp_stats, rel=1e-9, abs=1e-12)
    assert stats["behaviour_weight_mean"] != 1.0
    assert {k for k in stats if k.startswith("behaviour_")} == set(behaviour_weights(old, beh, mask, cap=1.5)[1])
    loss.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)


def test_policy_loss_clip_eps_high_moves_only_the_upper_bound() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[math.log(1.25), math.log(0.75)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    _, sym = policy_loss(logp, old, adv, mask, 0.2)
    _, asym = policy_loss(logp, old, adv, mask, 0.2, clip_eps_high=0.28)
    assert sym["clip_frac"] == 1.0  # 1.25 > 1.2 with A > 0, and 0.75 < 0.8 with A < 0
    assert asym["clip_frac"] == 0.5  # 1.25 < 1.28 now; the lower bound still bites


def test_policy_loss_of_fully_empty_mask_is_zero_with_zero_grads() -> None:
    logp, old, adv, _ = policy_inputs(30)
    x = leaf(logp)
    empty = torch.zeros(logp.shape, dtype=torch.bool)
    loss, stats = policy_loss(x, old, adv, empty, 0.2, behaviour_logp=old, behaviour_weight_cap=2.0)
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in stats.values())
    loss.backward()
    assert x.grad is not None and (x.grad == 0).all()


def test_policy_loss_single_token_response_gets_the_unclipped_gradient() -> None:
    mask = lengths_mask([1], width=3)
    x = leaf(torch.tensor([[-1.0, 0.0, 0.0]], dtype=torch.float64))
    loss, _ = policy_loss(x, x.detach(), torch.tensor([[2.0, 9.0, 9.0]], dtype=torch.float64), mask, 0.2)
    loss.backward()
    assert x.grad is not None
    assert_close(x.grad, torch.tensor([[-2.0, 0.0, 0.0]], dtype=torch.float64))  # d(-r*A)/dlogp at r = 1


@st.composite
def policy_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 4))
    r = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, r), min_size=b, max_size=b))
    floats = st.floats(-3, 3, allow_nan=False, width=64)
    n = b * r
    logp = -torch.tensor(draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float64).abs()
    old = -torch.tensor(draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float64).abs()
    adv = torch.tensor(draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float64)
    return logp.reshape(b, r), old.reshape(b, r), adv.reshape(b, r), lengths_mask(lengths, r)


@settings(max_examples=60, deadline=None)
@given(policy_batches(), st.sampled_from(AGGS), st.booleans())
def test_policy_loss_gradients_are_zero_at_padding(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], agg: AggMode, decoupled: bool
) -> None:
    logp, old, adv, mask = data
    x = leaf(dirty(logp, mask, 1e4))  # padding log-probs far outside any sane range
    beh = dirty(old - 0.5, mask, -1e4) if decoupled else None
    loss, stats = policy_loss(
        x, dirty(old, mask, -1e4), dirty(adv, mask, 1e4), mask, 0.2, None, agg, beh, 3.0
    )
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad[~mask] == 0).all()
    assert all(math.isfinite(v) for v in stats.values())


@settings(max_examples=60, deadline=None)
@given(policy_batches(), st.sampled_from(AGGS))
def test_policy_clip_frac_is_zero_when_logp_equals_old(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], agg: AggMode
) -> None:
    logp, _, adv, mask = data
    loss, stats = policy_loss(leaf(logp), logp, adv, mask, 0.2, None, agg)
    assert stats["clip_frac"] == 0.0
    assert stats["approx_kl"] == 0.0
    assert stats["ratio_mean"] == (1.0 if mask.any() else 0.0)
    assert stats["behaviour_weight_mean"] == 1.0
    # At ratio 1 the surrogate is just -A, aggregated.
    expected = ref_aggregate({c: -adv[c] for c in real_cells(mask)}, mask.shape[0], agg)
    assert_close(loss, expected)


# ---- value_loss -----------------------------------------------------------------------------


def ref_value(
    values: torch.Tensor,
    old: torch.Tensor,
    ret: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    agg: AggMode,
) -> tuple[torch.Tensor, dict[str, float]]:
    per_token: dict[tuple[int, int], torch.Tensor] = {}
    clipped, vals = [], []
    for i, t in real_cells(mask):
        v, o, r = values[i, t], float(old[i, t]), float(ret[i, t])
        unclipped = (v - r) ** 2
        if clip is None:
            per_token[(i, t)] = 0.5 * unclipped
            clipped.append(0.0)
        else:
            vc = o + torch.clamp(v - o, -clip, clip)
            c = (vc - r) ** 2
            per_token[(i, t)] = 0.5 * torch.maximum(unclipped, c)
            clipped.append(float(float(c.detach()) > float(unclipped.detach())))
        vals.append(float(v.detach()))
    n = len(vals)
    stats = {"vf_clip_frac": sum(clipped) / n if n else 0.0, "value_mean": sum(vals) / n if n else 0.0}
    return ref_aggregate(per_token, mask.shape[0], agg), stats


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loop_reference_in_value_grad_and_stats(agg: AggMode, clip: float | None) -> None:
    mask = lengths_mask(LENGTHS)
    old = randn(mask.shape, 40)
    values = old + randn(mask.shape, 41, scale=0.4)
    ret = randn(mask.shape, 42)
    x, xr = leaf(dirty(values, mask)), leaf(values)
    loss, stats = value_loss(x, dirty(old, mask, -GARBAGE), dirty(ret, mask, float("inf")), mask, clip, agg)
    expected, exp_stats = ref_value(xr, old, ret, mask, clip, agg)
    assert_close(loss, expected)
    assert stats == pytest.approx(exp_stats, rel=1e-9, abs=1e-12)
    if clip is not None:
        assert 0 < stats["vf_clip_frac"] < 1
    loss.backward()
    expected.backward()
    assert x.grad is not None and (x.grad[~mask] == 0).all()
    assert_close(x.grad, xr.grad)


def test_value_loss_of_fully_empty_mask_is_zero_with_zero_grads() -> None:
    x = leaf(randn((2, 3), 43))
    loss, stats = value_loss(x, x.detach(), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0.2)
    assert loss.item() == 0.0 and stats == {"vf_clip_frac": 0.0, "value_mean": 0.0}
    loss.backward()
    assert x.grad is not None and (x.grad == 0).all()


# ---- entropy_from_logits --------------------------------------------------------------------


def ref_entropy(row: list[float]) -> float:
    m = max(row)
    z = sum(math.exp(v - m) for v in row)
    ps = [math.exp(v - m) / z for v in row]
    return -sum(p * math.log(p) for p in ps if p > 0)


def test_entropy_from_logits_matches_loop_reference() -> None:
    logits = randn((2, 3, 7), 50, scale=3.0)
    out = entropy_from_logits(logits)
    expected = torch.tensor(
        [[ref_entropy(logits[i, t].tolist()) for t in range(3)] for i in range(2)], dtype=torch.float64
    )
    assert out.shape == (2, 3)
    assert_close(out, expected)


def test_entropy_from_logits_is_stable_for_huge_logits_and_uniform_is_log_v() -> None:
    big = torch.tensor([[1e4, 1e4 - 1.0, 1e4 - 3.0]])
    assert_close(
        entropy_from_logits(big), torch.tensor([ref_entropy([0.0, -1.0, -3.0])], dtype=torch.float32)
    )
    assert_close(entropy_from_logits(torch.zeros(4, 11)), torch.full((4,), math.log(11)))


def test_entropy_from_logits_handles_minus_inf_logits_in_forward_and_backward() -> None:
    logits = leaf(torch.tensor([[0.0, 1.0, -math.inf, -math.inf]], dtype=torch.float64))
    out = entropy_from_logits(logits)
    assert_close(out, torch.tensor([ref_entropy([0.0, 1.0])], dtype=torch.float64))
    out.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 2:] == 0).all()


def test_entropy_from_logits_keeps_bf16_dtype() -> None:
    logits = randn((3, 5), 51).to(torch.bfloat16)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.bfloat16
    expected = torch.tensor([ref_entropy(logits[i].double().tolist()) for i in range(3)], dtype=torch.float64)
    assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


# ---- kl_loss --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGS)
def test_kl_loss_matches_loop_reference_and_grads_flow_only_through_logp(kind: KLKind, agg: AggMode) -> None:
    mask = lengths_mask(LENGTHS)
    lp, ref = -randn(mask.shape, 60).abs(), -randn(mask.shape, 61).abs()
    x, xr = leaf(dirty(lp, mask)), leaf(lp)
    ref_in = leaf(dirty(ref, mask, -GARBAGE))
    loss = kl_loss(x, ref_in, mask, kind, agg)

    def k(i: int, t: int) -> torch.Tensor:
        d = xr[i, t] - float(ref[i, t])
        if kind == "k1":
            return d
        if kind == "k2":
            return 0.5 * d * d
        return torch.exp(-d) + d - 1.0

    expected = ref_aggregate({c: k(*c) for c in real_cells(mask)}, mask.shape[0], agg)
    assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)
    assert ref_in.grad is None


def test_kl_loss_of_fully_empty_mask_is_zero() -> None:
    x = leaf(randn((2, 3), 62))
    loss = kl_loss(
        x, torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.bool), "k3", "token_mean"
    )
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad is not None and (x.grad == 0).all()
