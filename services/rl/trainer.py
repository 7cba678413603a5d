"""Policy and value updates: PPO epochs over shuffled minibatches. Pure torch, no I/O; the actor and
critic services and the local loop all train through these two classes."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from services.core.config import AlgoSection
from services.models.critic import ValueModel
from services.models.logprobs import response_logprobs
from services.rl.batch import Rollout
from services.rl.losses import aggregate, kl_loss, policy_loss, value_loss


def _minibatches(n: int, size: int, gen: torch.Generator) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    return [perm[i : i + size] for i in range(0, n, size)]


def _mean(acc: dict[str, list[float]]) -> dict[str, float]:
    return {k: sum(v) / len(v) for k, v in acc.items() if v}


class PolicyTrainer:
    def __init__(self, model: nn.Module, algo: AlgoSection, temperature: float, seed: int = 0) -> None:
        self.model = model
        self.algo = algo
        self.temperature = temperature
        self.seed = seed
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=algo.lr, weight_decay=0.0
        )

    def _logprobs(self, r: Rollout, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = response_logprobs(
            self.model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask,
            temperature=self.temperature, with_entropy=with_entropy,
        )
        if isinstance(out, tuple):
            return out[0], out[1]
        return out, None

    def train_step(self, r: Rollout, step: int, current_version: int) -> dict[str, float]:
        if r.advantages is None:
            raise ValueError("train_step needs advantages: run compute_advantages first")
        algo = self.algo
        self.model.train()
        # Off-policy rows (generated under an older version) are clipped against the proximal policy,
        # i.e. the weights right before this step, and weighted by proximal/behaviour (decoupled PPO).
        # A fully on-policy batch skips the extra forward: proximal and behaviour are the same weights.
        versions = r.versions if r.versions is not None else torch.full((len(r),), r.version)
        off_policy = algo.decoupled and bool((versions < current_version).any())
        if off_policy:
            with torch.no_grad():
                old = torch.cat([
                    self._logprobs(r.select(idx), False)[0]
                    for idx in torch.arange(len(r)).split(algo.minibatch_size)
                ])
            behaviour: torch.Tensor | None = r.behaviour_logprobs
        else:
            old, behaviour = r.behaviour_logprobs, None

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        acc: dict[str, list[float]] = defaultdict(list)
        for _ in range(algo.ppo_epochs):
            for idx in _minibatches(len(r), algo.minibatch_size, gen):
                mb = r.select(idx)
                logp, ent = self._logprobs(mb, with_entropy=True)
                loss, st = policy_loss(
                    logp, old[idx], mb.advantages, mb.response_mask,  # type: ignore[arg-type]
                    clip_eps=algo.clip_eps, clip_eps_high=algo.clip_eps_high, agg=algo.loss_agg,
                    behaviour_logp=None if behaviour is None else behaviour[idx],
                    behaviour_weight_cap=algo.behaviour_weight_cap,
                )
                acc["policy_loss"].append(float(loss))
                if algo.kl_coef > 0 and algo.kl_in == "loss" and mb.ref_logprobs is not None:
                    kl = kl_loss(logp, mb.ref_logprobs, mb.response_mask, algo.kl_estimator, algo.loss_agg)
                    loss = loss + algo.kl_coef * kl
                    acc["kl_loss"].append(float(kl))
                assert ent is not None
                entropy = aggregate(ent, mb.response_mask, algo.loss_agg)
                if algo.entropy_coef > 0:
                    loss = loss - algo.entropy_coef * entropy
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
                self.opt.step()
                acc["entropy"].append(float(entropy))
                acc["grad_norm"].append(float(grad_norm))
                for k, v in st.items():
                    acc[k].append(v)
        self.model.eval()
        out = _mean(acc)
        out["off_policy"] = float(off_policy)
        return out


class ValueTrainer:
    def __init__(self, model: ValueModel, algo: AlgoSection, seed: int = 0) -> None:
        self.model = model
        self.algo = algo
        self.seed = seed
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=algo.critic_lr, weight_decay=0.0
        )

    def train_step(self, r: Rollout, step: int) -> dict[str, float]:
        if r.returns is None or r.values is None:
            raise ValueError("value training needs returns and the old values")
        algo = self.algo
        self.model.train()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 7)
        acc: dict[str, list[float]] = defaultdict(list)
        for _ in range(algo.ppo_epochs):
            for idx in _minibatches(len(r), algo.minibatch_size, gen):
                mb = r.select(idx)
                v = self.model.values(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask)
                loss, st = value_loss(
                    v, mb.values, mb.returns, mb.response_mask, clip=algo.value_clip, agg=algo.loss_agg,  # type: ignore[arg-type]
                )
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
                self.opt.step()
                acc["value_loss"].append(float(loss))
                for k, val in st.items():
                    acc[k].append(val)
        self.model.eval()
        return _mean(acc)
