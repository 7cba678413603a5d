"""Dr. GRPO, DAPO, GSPO, REINFORCE++-baseline, dual-clip PPO and bounded KL, each checked against a
float64 loop written from the published formula (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from services.core.config.run import AlgoSection, ConfigError, parse_config
from services.rl.advantages import group_mean_baseline, overlong_penalty
from services.rl.batch import Rollout
from services.rl.kl import kl_estimate
from services.rl.losses import aggregate, policy_loss
from services.rl.pipeline import MissingScores, batch_stats, compute_advantages
from tests.unit.test_rl_losses import GARBAGE, LENGTHS, dirty, leaf, lengths_mask, randn, real_cells

GROUPS = [0, 0, 0, 1, 1]  # two prompts: three and two samples


def rollout(scores: list[float], lengths: list[int], width: int = 6, seed: int = 0) -> Rollout:
    b = len(scores)
    mask = lengths_mask(lengths, width)
    return Rollout(
        task_ids=[f"t{i}" for i in range(b)],
        prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        response_ids=torch.ones(b, width, dtype=torch.long), response_mask=mask,
        behaviour_logprobs=-randn((b, width), seed).abs(), group_ids=torch.tensor(GROUPS[:b]),
        version=0, rewards=torch.tensor(scores, dtype=torch.float64),
        ref_logprobs=-randn((b, width), seed + 1).abs(),
    )


def row_values(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The advantage each non-empty row carries (constant over its real tokens)."""
    out = []
    for i in range(mask.shape[0]):
        toks = [float(adv[i, t]) for t in range(mask.shape[1]) if bool(mask[i, t])]
        assert len(set(toks)) <= 1
        out.append(toks[0] if toks else 0.0)
    return out


# ---- Dr. GRPO -------------------------------------------------------------------------------


def test_dr_grpo_advantage_is_score_minus_group_mean_without_std() -> None:
    """Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", Sec. 3.2:
    A_i = R(q, o_i) - mean_j R(q, o_j) (GRPO's division by std(R) removed)."""
    scores = [1.0, 0.0, 0.5, 2.0, -1.0]
    r = rollout(scores, [6, 3, 2, 1, 4])
    compute_advantages(r, AlgoSection(name="dr_grpo", group_size=3), max_new_tokens=6)
    expected = []
    for i, s in enumerate(scores):
        group = [x for x, g in zip(scores, GROUPS, strict=True) if g == GROUPS[i]]
        expected.append(s - sum(group) / len(group))
    assert row_values(r.advantages, r.response_mask.bool()) == pytest.approx(expected, abs=1e-6)


def test_grpo_norm_std_false_equals_dr_grpo_advantages() -> None:
    a, b = rollout([1.0, 0.0, 0.5, 2.0, -1.0], LENGTHS), rollout([1.0, 0.0, 0.5, 2.0, -1.0], LENGTHS)
    compute_advantages(a, AlgoSection(name="grpo", norm_std=False, group_size=3))
    compute_advantages(b, AlgoSection(name="dr_grpo", group_size=3), max_new_tokens=6)
    assert_close(a.advantages, b.advantages)


def test_seq_mean_token_sum_norm_divides_every_response_sum_by_one_constant() -> None:
    """Dr. GRPO's unbiased aggregation: (1/G) sum_i (1/L_max) sum_t l_it, empty responses not counted
    (as the other sequence-mean modes)."""
    mask = lengths_mask(LENGTHS)
    x, xr = leaf(dirty(randn(mask.shape, 3), mask)), leaf(randn(mask.shape, 3))
    out = aggregate(x, mask, "seq_mean_token_sum_norm", norm_len=16)
    rows = [i for i in range(mask.shape[0]) if bool(mask[i].any())]
    zero = torch.zeros((), dtype=torch.float64)
    expected = sum((sum((xr[i, t] for t in range(mask.shape[1]) if bool(mask[i, t])), zero) / 16 for i in rows),
                   zero) / len(rows)
    assert_close(out, expected)
    out.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(x, mask, "seq_mean_token_sum_norm", norm_len=0)


def test_dr_grpo_defaults_and_the_constant_normaliser_is_the_generation_budget() -> None:
    cfg = parse_config({"algo": {"name": "dr_grpo"}, "generation": {"max_new_tokens": 24}})
    assert cfg.algo.loss_agg == "seq_mean_token_sum_norm"
    assert cfg.algo.loss_norm_len == 24
    assert cfg.algo.group_norm_std is False
    user = parse_config({"algo": {"name": "dr_grpo", "norm_std": True, "loss_agg": "token_mean"}})
    assert user.algo.group_norm_std is True and user.algo.loss_agg == "token_mean"
    assert parse_config({"algo": {"name": "grpo"}}).algo.group_norm_std is True


# ---- DAPO -----------------------------------------------------------------------------------


def dapo_length_reward(n: int, l_max: int, l_cache: int) -> float:
    """Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Eq. 13."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_dapo_overlong_penalty_is_the_papers_soft_punishment(factor: float) -> None:
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, max_len=20, buffer_len=8, factor=factor)
    expected = [factor * dapo_length_reward(int(n), 20, 8) for n in lengths]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=4, buffer_len=5, factor=1.0)


def test_dapo_shapes_scores_before_the_group_baseline_and_reports_the_penalty() -> None:
    scores, lengths = [1.0, 1.0, 1.0, 0.0, 0.0], [6, 5, 2, 6, 1]
    r = rollout(scores, lengths)
    algo = AlgoSection(name="dapo", group_size=3, overlong_buffer_len=2)
    stats = compute_advantages(r, algo, max_new_tokens=6)
    shaped = [s + dapo_length_reward(n, 6, 2) for s, n in zip(scores, lengths, strict=True)]
    ref = rollout(shaped, lengths)
    compute_advantages(ref, AlgoSection(name="grpo", group_size=3))
    assert_close(r.advantages, ref.advantages)
    assert stats["reward_mean"] == pytest.approx(sum(scores) / 5)  # the task's reward, unshaped
    assert stats["overlong_penalty_mean"] == pytest.approx(sum(shaped) / 5 - sum(scores) / 5)


def test_dapo_defaults_clip_higher_token_loss_and_a_quarter_budget_window() -> None:
    cfg = parse_config({"algo": {"name": "dapo"}, "generation": {"max_new_tokens": 16}})
    assert (cfg.algo.clip_eps, cfg.algo.clip_eps_high, cfg.algo.loss_agg) == (0.2, 0.28, "token_mean")
    assert cfg.algo.overlong_buffer_len == 4
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        parse_config({"algo": {"name": "dapo", "overlong_buffer_len": 20}, "generation": {"max_new_tokens": 16}})


# ---- GSPO -----------------------------------------------------------------------------------


def test_gspo_loss_is_the_sequence_level_clipped_objective_in_value_and_gradient() -> None:
    """Zheng et al. 2025, "Group Sequence Policy Optimization", Eq. 5-7:
    J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i),
    s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|) = exp((1/|y_i|) sum_t log r_it)."""
    mask = lengths_mask(LENGTHS)
    old = -randn(mask.shape, 20).abs() - 0.1
    logp = old + randn(mask.shape, 21, scale=0.02)  # sequence ratios on both sides of a small clip
    seq_adv = randn((mask.shape[0],), 22)
    adv = seq_adv[:, None].expand(mask.shape).clone()
    eps, eps_high = 3e-3, 4e-3
    x, xr = leaf(dirty(logp, mask)), leaf(logp)
    loss, stats = policy_loss(x, dirty(old, mask, -GARBAGE), adv, mask, eps, eps_high,
                              agg="seq_mean_token_mean", ratio_level="sequence")
    terms, clipped = [], 0
    for i in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if bool(mask[i, t])]
        if not cols:
            continue
        s = torch.exp(sum(xr[i, t] - old[i, t] for t in cols) / len(cols))
        a = float(seq_adv[i])
        terms.append(torch.minimum(s * a, s.clamp(1 - eps, 1 + eps_high) * a))
        clipped += int((float(s.detach()) > 1 + eps_high and a > 0) or (float(s.detach()) < 1 - eps and a < 0))
    expected = -sum(terms, torch.zeros((), dtype=torch.float64)) / len(terms)
    assert_close(loss, expected)
    assert 0 < clipped < len(terms)  # the inputs exercise both branches
    loss.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)
    assert stats["ratio_mean"] > 0


def test_gspo_defaults_use_sequence_ratios_and_the_papers_clip_range() -> None:
    algo = parse_config({"algo": {"name": "gspo"}}).algo
    assert algo.ratio_level == "sequence"
    assert (algo.clip_eps, algo.clip_eps_high, algo.loss_agg) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert parse_config({"algo": {"name": "grpo"}}).algo.ratio_level == "token"


# ---- REINFORCE++ with baseline --------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_baseline_is_group_mean_baseline_then_batch_whitened_returns(gamma: float) -> None:
    """Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage
    Normalization", REINFORCE++-baseline: r_i - mean_group(r), minus the per-token KL penalty,
    return-to-go G_t = sum_{s>=t} gamma^(s-t) r_s, then whitened over every token of the batch."""
    scores, lengths, coef = [1.0, 0.0, 0.5, 2.0, -1.0], [6, 3, 2, 1, 4], 0.1
    r = rollout(scores, lengths, seed=7)
    algo = AlgoSection(name="reinforce_pp_baseline", group_size=3, kl_coef=coef, kl_in="reward", gamma=gamma)
    compute_advantages(r, algo)
    mask = r.response_mask.bool()
    means = {g: sum(s for s, h in zip(scores, GROUPS, strict=True) if h == g) / GROUPS.count(g) for g in set(GROUPS)}
    returns: dict[tuple[int, int], float] = {}
    for i, n in enumerate(lengths):
        tok = [-coef * (float(r.behaviour_logprobs[i, t]) - float(r.ref_logprobs[i, t])) for t in range(n)]
        if n:
            tok[-1] += scores[i] - means[GROUPS[i]]
        running = 0.0
        for t in reversed(range(n)):
            running = tok[t] + gamma * running
            returns[(i, t)] = running
    vals = list(returns.values())
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
    for (i, t), v in returns.items():
        assert float(r.advantages[i, t]) == pytest.approx((v - mu) / (sd + 1e-8), rel=1e-4, abs=1e-5)
    assert all(float(r.advantages[i, t]) == 0 for i in range(5) for t in range(6) if not bool(mask[i, t]))


def test_group_mean_baseline_gives_a_group_of_one_zero() -> None:
    out = group_mean_baseline(torch.tensor([3.0, 1.0, 5.0]), torch.tensor([0, 0, 1]))
    assert out.tolist() == [1.0, -1.0, 0.0]


# ---- Dual-clip PPO --------------------------------------------------------------------------


def test_dual_clip_bounds_negative_advantage_tokens_at_c_times_a() -> None:
    """Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
    Eq. 5: for A < 0 the objective is max(min(r A, clip(r, 1-eps, 1+eps) A), c A); for A >= 0 PPO's."""
    mask = lengths_mask(LENGTHS)
    old = -randn(mask.shape, 30).abs() - 0.1
    logp = old + randn(mask.shape, 31, scale=1.5)  # ratios far above c on some tokens
    adv = randn(mask.shape, 32)
    eps, c = 0.2, 3.0
    x, xr = leaf(dirty(logp, mask)), leaf(logp)
    loss, stats = policy_loss(x, old, dirty(adv, mask), mask, eps, agg="token_mean", dual_clip_c=c)
    terms, hits = [], 0
    for i, t in real_cells(mask):
        ratio, a = torch.exp(xr[i, t] - old[i, t]), float(adv[i, t])
        obj = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        if a < 0:
            hits += int(float(obj.detach()) < c * a)
            obj = torch.maximum(obj, torch.tensor(c * a, dtype=torch.float64))
        terms.append(-obj)
    expected = sum(terms, torch.zeros((), dtype=torch.float64)) / len(terms)
    assert_close(loss, expected)
    assert hits > 0 and stats["dual_clip_frac"] == pytest.approx(hits / len(terms))
    loss.backward()
    expected.backward()
    assert_close(x.grad, xr.grad)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(x, old, adv, mask, eps, dual_clip_c=1.0)


# ---- KL -------------------------------------------------------------------------------------


def verl_low_var_kl(lp: float, ref: float) -> float:
    """verl's low_var_kl (Schulman's k3 with its bounds): kl = ref - lp clamped to +-20,
    exp(kl) - kl - 1 clamped to +-10."""
    kl = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1.0, -10.0), 10.0)


def test_kl_estimates_are_bounded_by_default_and_low_var_kl_matches_verl() -> None:
    lp = torch.tensor([[0.0, -4.0, -1.0, -500.0, 0.3]], dtype=torch.float64)
    ref = torch.tensor([[-4.0, 0.0, -1.2, 0.0, 0.1]], dtype=torch.float64)
    for kind in ("k3", "low_var_kl"):
        got = kl_estimate(lp, ref, kind)  # type: ignore[arg-type]
        pairs = zip(lp[0].tolist(), ref[0].tolist(), strict=True)
        assert got.tolist()[0] == pytest.approx([verl_low_var_kl(a, b) for a, b in pairs])
    assert float(kl_estimate(lp, ref, "k3").abs().max()) <= 10.0
    assert kl_estimate(lp, ref, "k1", clamp=None)[0, 3].item() == -500.0
    assert kl_estimate(lp, ref, "k1")[0, 3].item() == -10.0
    assert_close(kl_estimate(lp, ref, "abs", clamp=None), (lp - ref).abs())


def test_kl_in_reward_uses_its_own_estimator() -> None:
    r1, r3 = rollout([1.0, 0.0, 0.5, 2.0, -1.0], LENGTHS), rollout([1.0, 0.0, 0.5, 2.0, -1.0], LENGTHS)
    base = {"name": "grpo", "group_size": 3, "kl_coef": 0.1, "kl_in": "reward", "kl_estimator": "k3"}
    s1 = compute_advantages(r1, AlgoSection(**base))
    s3 = compute_advantages(r3, AlgoSection(**base, kl_estimator_reward="k3"))
    mask = r1.response_mask.bool()
    diff = (r1.behaviour_logprobs - r1.ref_logprobs)[mask]
    assert s1["kl"] == pytest.approx(float(diff.mean()))  # k1 by default, as verl
    assert s3["kl"] == pytest.approx(float((torch.expm1(-diff) + diff).mean()))


@pytest.mark.parametrize("name", ["dapo", "ppo", "reinforce_pp_baseline", "rloo"])
def test_a_journaled_batch_reports_the_stats_its_step_computed(name: str) -> None:
    """A step the controller resumes from its journaled batch (advantages already in it) writes the
    same figures its first attempt computed: reward, advantage, length, KL, overlong penalty."""
    extra = {"overlong_buffer_len": 2} if name == "dapo" else {}
    algo = AlgoSection(name=name, group_size=3, kl_coef=0.05, **extra)
    r = rollout([1.0, 0.0, 0.5, 2.0, -1.0], LENGTHS)
    if name == "ppo":
        r.values = randn(tuple(r.response_mask.shape), 7)
    first = compute_advantages(r, algo, max_new_tokens=6)
    assert {"reward_mean", "adv_abs_mean", "kl"} <= set(first)
    assert batch_stats(r, algo, max_new_tokens=6) == first
    r.advantages = None
    with pytest.raises(MissingScores, match="no rewards or advantages"):
        batch_stats(r, algo, max_new_tokens=6)
