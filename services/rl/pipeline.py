"""From a scored rollout to advantages, per algorithm. Shared by the local loop and the controller,
so the fleet and the single-process baseline compute the exact same thing."""

from __future__ import annotations

import torch

from services.core.config.run import AlgoSection, BehaviourLogprobs
from services.rl.advantages import (
    gae,
    group_mean_baseline,
    grpo_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)
from services.rl.batch import Rollout
from services.rl.kl import kl_estimate
from services.rl.masked import masked_mean, masked_sum, masked_whiten


class MissingScores(ValueError):
    pass


def compute_advantages(r: Rollout, algo: AlgoSection, max_new_tokens: int | None = None,
                       behaviour_logprobs: BehaviourLogprobs = "engine") -> dict[str, float]:
    """Fill `r.advantages` (and `r.returns` for PPO) in place; return step statistics.

    `max_new_tokens` is the generation budget DAPO's overlong shaping measures lengths against;
    `behaviour_logprobs` is generation.behaviour_logprobs ("trainer": the rollout's are not computed).
    """
    mask = r.response_mask
    if r.rewards is None:
        raise MissingScores("rollout has no rewards: the reward stage has not scored it")
    scores = r.rewards.float()
    penalty = _overlong(r, algo, max_new_tokens)
    if penalty is not None:
        scores = scores + penalty
    kl = _kl(r, algo, behaviour_logprobs)
    in_reward = algo.kl_coef if (kl is not None and algo.kl_in == "reward") else 0.0

    if algo.name == "ppo":
        if r.values is None:
            raise MissingScores("ppo needs critic values but the rollout has none")
        tok_r = token_level_rewards(scores, mask, kl, in_reward)
        adv, ret = gae(tok_r, r.values.float(), mask, algo.gamma, algo.lam)
        r.advantages, r.returns = masked_whiten(adv, mask), ret
    elif algo.name in ("reinforce_pp", "reinforce_pp_baseline"):
        base = group_mean_baseline(scores, r.group_ids) if algo.name == "reinforce_pp_baseline" else scores
        tok_r = token_level_rewards(base, mask, kl, in_reward)
        r.advantages = reinforce_pp_advantages(tok_r, mask, algo.gamma)
    else:
        # Group baselines work on sequence scores, so a KL-in-reward penalty is summed per sequence.
        seq = scores - in_reward * masked_sum(kl, mask, dim=1) if (kl is not None and in_reward) else scores
        if algo.name == "rloo":
            r.advantages = rloo_advantages(seq, r.group_ids, mask)
        else:  # grpo, dr_grpo, dapo, gspo: the group-normalised advantage
            r.advantages = grpo_advantages(seq, r.group_ids, mask, norm_std=algo.group_norm_std,
                                           eps=algo.advantage_eps)

    return _stats(r, penalty, kl)


def batch_stats(r: Rollout, algo: AlgoSection, max_new_tokens: int | None = None,
                behaviour_logprobs: BehaviourLogprobs = "engine") -> dict[str, float]:
    """The step statistics of a rollout whose advantages are already computed: what a step resumed
    from its journaled batch reports, identical to what `compute_advantages` returned for it."""
    if r.rewards is None or r.advantages is None:
        raise MissingScores("the batch carries no rewards or advantages")
    return _stats(r, _overlong(r, algo, max_new_tokens), _kl(r, algo, behaviour_logprobs))


def _overlong(r: Rollout, algo: AlgoSection, max_new_tokens: int | None) -> torch.Tensor | None:
    if algo.overlong_buffer_len is None:
        return None
    if max_new_tokens is None:
        raise ValueError("overlong shaping needs the generation budget (max_new_tokens)")
    lengths = r.response_mask.sum(dim=1)
    return overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer_len, algo.overlong_penalty_factor)


def _kl(r: Rollout, algo: AlgoSection, behaviour_logprobs: BehaviourLogprobs) -> torch.Tensor | None:
    if not algo.needs_reference:
        return None
    if r.ref_logprobs is None:
        raise MissingScores("kl_coef > 0 but the rollout has no reference log-probs")
    if behaviour_logprobs == "trainer":
        # Zeros, not log-probs: no KL from them, neither a penalty (the config refuses kl_in reward)
        # nor the "kl" metric, which would be garbage.
        if algo.kl_in == "reward":
            raise ValueError("kl_in 'reward' needs behaviour log-probs; generation.behaviour_logprobs is 'trainer'")
        return None
    kind = algo.kl_estimator_reward if algo.kl_in == "reward" else algo.kl_estimator
    return kl_estimate(r.behaviour_logprobs.float(), r.ref_logprobs.float(), kind, algo.kl_clamp)


def _stats(r: Rollout, penalty: torch.Tensor | None, kl: torch.Tensor | None) -> dict[str, float]:
    assert r.rewards is not None and r.advantages is not None
    mask, rewards = r.response_mask, r.rewards.float()
    stats: dict[str, float] = {}
    if penalty is not None:
        stats["overlong_penalty_mean"] = float(penalty.mean())
    stats.update({
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "adv_abs_mean": float(masked_mean(r.advantages.abs(), mask)),
        "response_len_mean": float(mask.sum(dim=1).float().mean()),
    })
    if kl is not None:
        stats["kl"] = float(masked_mean(kl, mask))
    if r.returns is not None:
        stats["return_mean"] = float(masked_mean(r.returns, mask))
    return stats
