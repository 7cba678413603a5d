"""Policy and value updates: PPO epochs over shuffled minibatches. Pure torch, no I/O; the actor and
critic services and the local loop all train through these two classes."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from services.core.config.run import AlgoSection, BehaviourLogprobs
from services.models.nets.critic import ValueModel
from services.models.nets.logprobs import (
    COMPILE_BACKEND,
    CompileCount,
    autocast,
    compile_decoder,
    response_logprobs,
    use_tf32,
    wants_compile,
)
from services.models.nets.lora import is_lora
from services.rl.batch import Rollout
from services.rl.losses import aggregate, kl_loss, policy_loss_terms, value_loss_terms
from services.rl.micro import MicroBatch, part_of, plan, score_rows
from services.rl.packing import packed_logprobs, packed_values
from services.rl.warmup import full_prompt, warm_up_rollouts


def _minibatches(n: int, size: int, gen: torch.Generator) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    return [perm[i : i + size] for i in range(0, n, size)]


def _mean(acc: dict[str, list[float]]) -> dict[str, float]:
    """Each statistic's mean over a step's optimizer steps; a maximum (`*_max`) stays the maximum."""
    return {k: max(v) if is_max(k) else sum(v) / len(v) for k, v in acc.items() if v}


def is_max(key: str) -> bool:
    return key.endswith("_max")


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block's activations in the backward pass instead of keeping them.

    `model` is a transformers model or wraps one as `.backbone` (the value model). Non-reentrant
    checkpointing: the reentrant form drops the gradient of a block whose inputs need none."""
    target = getattr(model, "backbone", model)
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(target).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def adamw(model: nn.Module, lr: float, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; `fused` picks torch's fused kernel (CUDA and CPU)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True if fused else None)


def micro_weights(mb: Rollout, micro: int, agg: str) -> list[tuple[torch.Tensor, float]]:
    """Micro-batches of `micro` rows and their loss weights (`services.rl.micro.plan`)."""
    return [(m.rows, m.weight) for m in plan(mb, agg, size=micro)]


def micro_plan(mb: Rollout, algo: AlgoSection) -> list[MicroBatch]:
    return plan(mb, algo.loss_agg, algo.micro_batch_size, algo.micro_batch_tokens, algo.pack_sequences)


# How a minibatch is cut into weighted micro-batches; a data-parallel rank swaps in its own share
# (services.dist.shard) so that the sum over ranks is the one-rank gradient.
SplitFn = Callable[[Rollout, AlgoSection], list[MicroBatch]]


class PolicyTrainer:
    """PPO-style policy updates on whatever device the model lives on; rollouts arrive on the CPU and
    move one micro-batch at a time."""

    def __init__(self, model: nn.Module, algo: AlgoSection, temperature: float, seed: int = 0,
                 gradient_checkpointing: bool = False, behaviour_logprobs: BehaviourLogprobs = "engine",
                 ranks: int = 1, max_staleness: int = 1) -> None:
        if algo.proximal == "sampled" and ranks > 1:
            raise ValueError("algo.proximal 'sampled' keeps whole copies of the weights: one trainer rank only"
                             f" (this one has {ranks}); use 'current'")
        self.model = model
        self.algo = algo
        self.temperature = temperature
        self.seed = seed
        self.behaviour_logprobs = behaviour_logprobs  # generation.behaviour_logprobs
        self.device = _device_of(model)
        self.split: SplitFn = micro_plan
        self.tf32 = use_tf32(algo.tf32, self.device)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        # torch.compile's backend for the decoder's blocks and the vocabulary-sized log-prob steps.
        wanted = wants_compile(algo.compile, self.device, ranks, is_lora(model))
        self.compile_backend = COMPILE_BACKEND if wanted else None
        if self.compile_backend is not None:
            compile_decoder(model, self.compile_backend)
        self.opt = adamw(model, algo.lr, algo.fused_optimizer)
        # algo.proximal "sampled": the trainable weights of the last versions, by version, on their device.
        self.sampled = WeightVersions(model, max(1, max_staleness)) if algo.proximal == "sampled" else None

    def warm_up(self, vocab: int, proximal: bool = False, step_rows: int = 0, response_tokens: int = 0) -> bool:
        """Compile what a step runs (`services.rl.warmup`) before the first step; False, doing nothing,
        without compile. Forward and backward passes on small rollouts and, given a step's rows and
        its responses' most tokens, on rollouts as large as its largest micro-batch; with `proximal`
        the no-grad proximal forward too. No optimizer step, and the gradients are dropped: the
        weights stay as they are."""
        if self.compile_backend is None:
            return False
        full = None
        if step_rows > 0 and response_tokens > 0:
            full = (self.micro_rows(step_rows, response_tokens + full_prompt(response_tokens)), response_tokens)
        self.model.train()
        try:
            for r in warm_up_rollouts(vocab, full):
                for m in self.split(r, self.algo):
                    part = part_of(r, m).to(self.device)
                    if proximal:
                        with torch.no_grad():
                            self._logprobs(part, False, m.bins)
                    logp, ent = self._logprobs(part, with_entropy=True, bins=m.bins)
                    loss = -(logp * part.response_mask).sum()
                    if ent is not None and ent.requires_grad:
                        loss = loss - (ent * part.response_mask).sum()
                    loss.backward()
        finally:
            self.opt.zero_grad(set_to_none=True)
            self.model.eval()
        return True

    def micro_rows(self, step_rows: int, width: int) -> int:
        """Rows of the largest micro-batch a step of `step_rows` rows of `width` tokens trains on."""
        rows = min(self.algo.minibatch_size, step_rows)
        if self.algo.micro_batch_size:
            return min(rows, self.algo.micro_batch_size)
        if self.algo.micro_batch_tokens:
            return max(1, min(rows, self.algo.micro_batch_tokens // width))
        return rows

    def _logprobs(self, r: Rollout, with_entropy: bool,
                  bins: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(self.algo.autocast, self.device):
            if bins is not None:
                return packed_logprobs(self.model, r, bins, temperature=self.temperature, with_entropy=with_entropy,
                                       entropy_grad=self.algo.entropy_coef > 0,
                                       compile_backend=self.compile_backend)
            out = response_logprobs(
                self.model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask,
                temperature=self.temperature, with_entropy=with_entropy,
                entropy_grad=self.algo.entropy_coef > 0, chunk_tokens=self.algo.logprob_chunk_tokens,
                compile_backend=self.compile_backend,
            )
        if isinstance(out, tuple):
            return out[0], out[1]
        return out, None

    def _score(self, r: Rollout) -> torch.Tensor:
        """The policy's log-probs of a rollout's tokens at the weights it holds now, no grad, `[B, R]` on the CPU."""
        algo = self.algo
        with torch.no_grad():
            return score_rows(r, self.device, lambda p: self._logprobs(p, False)[0],
                              lambda p, bins: self._logprobs(p, False, bins)[0],
                              size=algo.micro_batch_size or algo.minibatch_size, tokens=algo.micro_batch_tokens,
                              pack=algo.pack_sequences)

    def weights_move_within(self, rows: int) -> bool:
        """Whether a batch of `rows` takes more than one optimizer step. With one (one epoch, one
        minibatch) every micro-batch's forward runs at the proximal weights, so its own log-probs,
        detached, are the proximal policy's: the separate no-grad pass, a quarter of the step's FLOPs,
        is needed only when the weights move within the batch."""
        return self.algo.ppo_epochs > 1 or self.algo.minibatch_size < rows

    def train_step(self, r: Rollout, step: int, current_version: int) -> dict[str, float]:
        if r.advantages is None:
            raise ValueError("train_step needs advantages: run compute_advantages first")
        algo = self.algo
        compiles = CompileCount() if self.compile_backend is not None else None
        self.model.train()
        # Decoupled PPO (algo.decoupled): every batch is clipped against the proximal policy, the trainer's
        # own log-probs at the weights right before this step, and weighted by proximal/behaviour
        # (algo.behaviour_correction), so the clip acts on what this update changes and the weight on
        # what the engine sampled differently: its numerics on an on-policy batch, and the versions
        # since on a stale one. Without engine log-probs (behaviour_logprobs "trainer": the rollout's are
        # zeros) every batch clips against the proximal forward and nothing weights it.
        versions = r.versions if r.versions is not None else torch.full((len(r),), r.version)
        off_policy = bool((versions < current_version).any())
        engine_logprobs = self.behaviour_logprobs == "engine"
        # A response's sum is divided by one constant whatever width its micro-batch is cut to.
        norm_len = algo.loss_norm_len or r.response_ids.shape[1]
        proximal = algo.decoupled or not engine_logprobs  # clip against the proximal policy, not the behaviour
        proximal_forward = proximal and self.weights_move_within(len(r))
        weighted = proximal and engine_logprobs and algo.behaviour_correction != "none"
        behaviour = r.behaviour_logprobs if weighted else None
        # `old`: the behaviour's log-probs, the proximal ones scored up front, or None: each forward's own.
        old: torch.Tensor | None = None if proximal else r.behaviour_logprobs
        sampled_rows = fallback_rows = 0
        # algo.proximal "sampled" on a stale batch: each version's rows scored at the weights that sampled
        # them; where those are not kept (after a restart), and for current rows, at the current weights.
        by_version = proximal and self.sampled is not None and off_policy
        if proximal_forward and not by_version:
            old = self._score(r)
        if by_version:
            assert self.sampled is not None
            old = torch.zeros(r.response_ids.shape)
            for v in sorted(set(versions.tolist())):
                rows = (versions == v).nonzero()[:, 0]
                kept = v < current_version and self.sampled.has(v)
                fallback_rows += int(v < current_version and not kept) * len(rows)
                with self.sampled.swapped_in(v) if kept else contextlib.nullcontext():
                    old[rows] = self._score(r.select(rows))
                sampled_rows += len(rows) if kept else 0
        if self.sampled is not None:  # the weights the engine samples the next batches with, before they move
            self.sampled.keep(current_version)

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        acc: dict[str, list[float]] = defaultdict(list)
        for _ in range(algo.ppo_epochs):
            for idx in _minibatches(len(r), algo.minibatch_size, gen):
                mb = r.select(idx)
                self.opt.zero_grad(set_to_none=True)
                sums = DeviceSums()
                for m in self.split(mb, algo):
                    w = m.weight
                    part = part_of(mb, m).to(self.device)
                    rows, width = idx[m.rows], part.response_ids.shape[1]
                    logp, ent = self._logprobs(part, with_entropy=True, bins=m.bins)
                    prox = logp.detach() if old is None else old[rows, :width].to(self.device)
                    loss, st = policy_loss_terms(
                        logp, prox, part.advantages, part.response_mask,  # type: ignore[arg-type]
                        clip_eps=algo.clip_eps, clip_eps_high=algo.clip_eps_high, agg=algo.loss_agg,
                        behaviour_logp=None if behaviour is None else behaviour[rows, :width].to(self.device),
                        behaviour_weight_cap=algo.behaviour_weight_cap, ratio_level=algo.ratio_level,
                        dual_clip_c=algo.dual_clip_c, norm_len=norm_len,
                        behaviour_correction=algo.behaviour_correction,
                        behaviour_weight_floor=algo.behaviour_weight_floor,
                    )
                    sums.add("policy_loss", loss, w)
                    if algo.kl_coef > 0 and algo.kl_in == "loss" and part.ref_logprobs is not None:
                        kl = kl_loss(logp, part.ref_logprobs, part.response_mask, algo.kl_estimator, algo.loss_agg,
                                     clamp=algo.kl_clamp, norm_len=norm_len)
                        loss = loss + algo.kl_coef * kl
                        sums.add("kl_loss", kl, w)
                    assert ent is not None
                    entropy = aggregate(ent, part.response_mask, algo.loss_agg, norm_len)
                    if algo.entropy_coef > 0:
                        loss = loss - algo.entropy_coef * entropy
                    (loss * w).backward()
                    sums.add("entropy", entropy, w)
                    for k, stat in st.items():
                        sums.add(k, stat, w)
                grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
                self.opt.step()
                sums.add("grad_norm", grad_norm, 1.0)
                for k, v in sums.read().items():
                    acc[k].append(v)
        self.model.eval()
        out = _mean(acc)
        out["off_policy"] = float(off_policy)
        out["proximal_forward"] = float(proximal_forward)
        if self.sampled is not None:
            out["proximal_sampled_rows"], out["proximal_fallback_rows"] = float(sampled_rows), float(fallback_rows)
        if compiles is not None:
            out["compiles"] = float(compiles.since("actor"))
        return out


class WeightVersions:
    """Copies of a model's trainable weights at the last `keep` versions, swapped in to score a batch at
    the weights that sampled it (algo.proximal "sampled"). Only trainable tensors are copied: frozen
    ones (a LoRA run's base) never change between versions."""

    def __init__(self, model: nn.Module, keep: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.limit = keep
        self.versions: dict[int, list[torch.Tensor]] = {}

    def keep(self, version: int) -> None:
        """Copy the weights as they are now as `version`, dropping the oldest past the limit."""
        if version not in self.versions:
            self.versions[version] = [p.detach().clone() for p in self.params]
        for v in sorted(self.versions)[:-self.limit]:
            del self.versions[v]

    def has(self, version: int) -> bool:
        return version in self.versions

    @contextlib.contextmanager
    def swapped_in(self, version: int) -> Iterator[None]:
        """The model holds `version`'s weights inside the block (no copy: the tensors trade places)."""
        saved = [p.data for p in self.params]
        try:
            for p, w in zip(self.params, self.versions[version], strict=True):
                p.data = w
            yield
        finally:
            for p, d in zip(self.params, saved, strict=True):
                p.data = d


class DeviceSums:
    """Weighted sums of a step's 0-d statistics, kept on their device and read back in one transfer.
    Reading a GPU value waits for the GPU; a read per micro-batch drains the queue of kernels the CPU
    keeps ahead of it (py-spy on the 0.5B fleet on the H200: a third of the trainer thread's time
    waited in such reads while the GPU ran the engine's kernels)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor, weight: float) -> None:
        """Add `weight * value` to the key's sum; a maximum (`*_max`) keeps the largest value, unweighted."""
        if isinstance(value, DTensor):  # a sharded (FSDP) model's grad norm
            value = value.full_tensor()
        v = value.detach().to(torch.float64)  # a Python float's precision, as the sums had
        if is_max(key):
            self._sums[key] = torch.maximum(self._sums[key], v) if key in self._sums else v
            return
        v = weight * v
        self._sums[key] = self._sums[key] + v if key in self._sums else v

    def read(self) -> dict[str, float]:
        if not self._sums:
            return {}
        device = next(iter(self._sums.values())).device
        values = torch.stack([v.to(device) for v in self._sums.values()]).tolist()
        return dict(zip(self._sums, values, strict=True))


class ValueTrainer:
    def __init__(self, model: ValueModel, algo: AlgoSection, seed: int = 0,
                 gradient_checkpointing: bool = False) -> None:
        self.model = model
        self.algo = algo
        self.seed = seed
        self.device = _device_of(model)
        self.split: SplitFn = micro_plan
        self.tf32 = use_tf32(algo.tf32, self.device)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.opt = adamw(model, algo.critic_lr, algo.fused_optimizer)

    def values(self, r: Rollout, bins: list[list[int]] | None = None) -> torch.Tensor:
        with autocast(self.algo.autocast, self.device):
            if bins is not None:
                return packed_values(self.model, r, bins).float()
            return self.model.values(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask).float()

    @torch.no_grad()
    def score(self, r: Rollout) -> torch.Tensor:
        """The critic's values for a rollout `[B, R]` (CPU), micro-batched as the trainer's forwards."""
        a = self.algo
        return score_rows(r, self.device, self.values, self.values, size=a.micro_batch_size,
                          tokens=a.micro_batch_tokens, pack=a.pack_sequences)

    def train_step(self, r: Rollout, step: int) -> dict[str, float]:
        if r.returns is None or r.values is None:
            raise ValueError("value training needs returns and the old values")
        algo = self.algo
        self.model.train()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 7)
        norm_len = algo.loss_norm_len or r.response_ids.shape[1]
        acc: dict[str, list[float]] = defaultdict(list)
        for _ in range(algo.ppo_epochs):
            for idx in _minibatches(len(r), algo.minibatch_size, gen):
                mb = r.select(idx)
                self.opt.zero_grad(set_to_none=True)
                sums = DeviceSums()
                for m in self.split(mb, algo):
                    w = m.weight
                    part = part_of(mb, m).to(self.device)
                    v = self.values(part, m.bins)
                    loss, st = value_loss_terms(
                        v, part.values, part.returns, part.response_mask, clip=algo.value_clip,  # type: ignore[arg-type]
                        agg=algo.loss_agg, norm_len=norm_len,
                    )
                    (loss * w).backward()
                    sums.add("value_loss", loss, w)
                    for k, stat in st.items():
                        sums.add(k, stat, w)
                nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
                self.opt.step()
                for k, val in sums.read().items():
                    acc[k].append(val)
        self.model.eval()
        return _mean(acc)
