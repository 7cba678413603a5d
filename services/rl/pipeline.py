"""From a scored rollout to advantages, per algorithm. Shared by the local loop and the controller,
so the fleet and the single-process baseline compute the exact same thing.

numpy throughout (the controller never imports torch): a `RolloutArrays` is computed on directly; a
torch `Rollout` (the local loop, tests) through its arrays, which are what the wire would carry
(float32 values), and gets its advantages (and returns) back as tensors sharing that memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
from services.rl.batch import Rollout, RolloutArrays
from services.rl.kl import kl_estimate
from services.rl.masked import masked_mean, masked_sum, masked_whiten

Array = np.ndarray[Any, Any]


class MissingScores(ValueError):
    pass


def _arrays(r: Rollout | RolloutArrays) -> RolloutArrays:
    return r if isinstance(r, RolloutArrays) else r.arrays()


def compute_advantages(r: Rollout | RolloutArrays, algo: AlgoSection, max_new_tokens: int | None = None,
                       behaviour_logprobs: BehaviourLogprobs = "engine") -> dict[str, float]:
    """Fill `r.advantages` (and `r.returns` for PPO) in place; return step statistics.

    `max_new_tokens` is the generation budget DAPO's overlong shaping measures lengths against;
    `behaviour_logprobs` is generation.behaviour_logprobs ("trainer": the rollout's are not computed).
    """
    a = _arrays(r)
    stats = _compute(a, algo, max_new_tokens, behaviour_logprobs)
    if a is not r:  # a torch Rollout: its tensors, sharing the arrays' memory
        import torch

        assert a.advantages is not None
        r.advantages = torch.from_numpy(a.advantages)  # type: ignore[assignment]
        if a.returns is not None:
            r.returns = torch.from_numpy(a.returns)  # type: ignore[assignment]
    return stats


def _compute(r: RolloutArrays, algo: AlgoSection, max_new_tokens: int | None,
             behaviour_logprobs: BehaviourLogprobs) -> dict[str, float]:
    mask = r.response_mask
    if r.rewards is None:
        raise MissingScores("rollout has no rewards: the reward stage has not scored it")
    scores = r.rewards.astype(np.float32)
    penalty = _overlong(r, algo, max_new_tokens)
    if penalty is not None:
        scores = scores + penalty
    kl = _kl(r, algo, behaviour_logprobs)
    in_reward = algo.kl_coef if (kl is not None and algo.kl_in == "reward") else 0.0

    if algo.name == "ppo":
        if r.values is None:
            raise MissingScores("ppo needs critic values but the rollout has none")
        tok_r = token_level_rewards(scores, mask, kl, in_reward)
        adv, ret = gae(tok_r, r.values.astype(np.float32), mask, algo.gamma, algo.lam)
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


def batch_stats(r: Rollout | RolloutArrays, algo: AlgoSection, max_new_tokens: int | None = None,
                behaviour_logprobs: BehaviourLogprobs = "engine") -> dict[str, float]:
    """The step statistics of a rollout whose advantages are already computed: what a step resumed
    from its journaled batch reports, identical to what `compute_advantages` returned for it."""
    a = _arrays(r)
    if a.rewards is None or a.advantages is None:
        raise MissingScores("the batch carries no rewards or advantages")
    return _stats(a, _overlong(a, algo, max_new_tokens), _kl(a, algo, behaviour_logprobs))


def _overlong(r: RolloutArrays, algo: AlgoSection, max_new_tokens: int | None) -> Array | None:
    if algo.overlong_buffer_len is None:
        return None
    if max_new_tokens is None:
        raise ValueError("overlong shaping needs the generation budget (max_new_tokens)")
    lengths = r.response_mask.sum(axis=1)
    return overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer_len, algo.overlong_penalty_factor)


def _kl(r: RolloutArrays, algo: AlgoSection, behaviour_logprobs: BehaviourLogprobs) -> Array | None:
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
    return kl_estimate(r.behaviour_logprobs.astype(np.float32), r.ref_logprobs.astype(np.float32), kind,
                       algo.kl_clamp)


def _stats(r: RolloutArrays, penalty: Array | None, kl: Array | None) -> dict[str, float]:
    assert r.rewards is not None and r.advantages is not None
    mask, rewards = r.response_mask, r.rewards.astype(np.float32)
    stats: dict[str, float] = {}
    if penalty is not None:
        stats["overlong_penalty_mean"] = float(penalty.mean())
    stats.update({
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0,  # unbiased, as torch's std
        "adv_abs_mean": float(masked_mean(np.abs(r.advantages), mask)),
        "response_len_mean": float(mask.sum(axis=1).astype(np.float32).mean()),
    })
    if kl is not None:
        stats["kl"] = float(masked_mean(kl, mask))
    if r.returns is not None:
        stats["return_mean"] = float(masked_mean(r.returns, mask))
    return stats
