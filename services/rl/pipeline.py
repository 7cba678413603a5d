"""From a scored rollout to advantages, per algorithm. Shared by the local loop and the controller,
so the fleet and the single-process baseline compute the exact same thing."""

from __future__ import annotations

import torch

from services.core.config import AlgoSection
from services.rl.advantages import (
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)
from services.rl.batch import Rollout
from services.rl.kl import kl_estimate
from services.rl.masked import masked_mean, masked_sum, masked_whiten


class MissingScores(ValueError):
    pass


def compute_advantages(r: Rollout, algo: AlgoSection) -> dict[str, float]:
    """Fill `r.advantages` (and `r.returns` for PPO) in place; return step statistics."""
    mask = r.response_mask
    if r.rewards is None:
        raise MissingScores("rollout has no rewards: the reward stage has not scored it")
    scores = r.rewards.float()
    kl = None
    if algo.needs_reference:
        if r.ref_logprobs is None:
            raise MissingScores("kl_coef > 0 but the rollout has no reference log-probs")
        kl = kl_estimate(r.behaviour_logprobs.float(), r.ref_logprobs.float(), algo.kl_estimator)
    in_reward = algo.kl_coef if (kl is not None and algo.kl_in == "reward") else 0.0

    if algo.name == "ppo":
        if r.values is None:
            raise MissingScores("ppo needs critic values but the rollout has none")
        tok_r = token_level_rewards(scores, mask, kl, in_reward)
        adv, ret = gae(tok_r, r.values.float(), mask, algo.gamma, algo.lam)
        r.advantages, r.returns = masked_whiten(adv, mask), ret
    elif algo.name == "reinforce_pp":
        tok_r = token_level_rewards(scores, mask, kl, in_reward)
        r.advantages = reinforce_pp_advantages(tok_r, mask, algo.gamma)
    else:
        # Group baselines work on sequence scores, so a KL-in-reward penalty is summed per sequence.
        seq = scores - in_reward * masked_sum(kl, mask, dim=1) if (kl is not None and in_reward) else scores
        fn = grpo_advantages if algo.name == "grpo" else rloo_advantages
        r.advantages = fn(seq, r.group_ids, mask)

    stats = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "adv_abs_mean": float(masked_mean(r.advantages.abs(), mask)),
        "response_len_mean": float(mask.sum(dim=1).float().mean()),
    }
    if kl is not None:
        stats["kl"] = float(masked_mean(kl, mask))
    if r.returns is not None:
        stats["return_mean"] = float(masked_mean(r.returns, mask))
    return stats


def group_solve_rate(r: Rollout) -> float:
    """Fraction of prompt groups with at least one positive reward (how much signal GRPO sees)."""
    assert r.rewards is not None
    groups = torch.unique(r.group_ids)
    hits = sum(bool((r.rewards[r.group_ids == g] > 0).any()) for g in groups)
    return hits / max(len(groups), 1)
