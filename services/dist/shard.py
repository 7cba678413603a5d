"""Data parallelism over the trainer's own micro-batching: which rows of a minibatch a rank trains
on, and with what weight, so that the gradients summed over the ranks are the one-rank gradient.

The one-rank trainer cuts a minibatch into micro-batches weighted by their share of the minibatch's
loss units (masked tokens for `token_mean`, non-empty responses otherwise). Every rank holds the
whole batch and draws the same minibatch permutation; rank r takes the r-th contiguous slice of
each minibatch's rows, cuts it the same way and weights each piece by its share of the *global*
minibatch, times the number of ranks: FSDP2 averages the gradients over the ranks (gloo has no
pre-multiplied sum to make it add them), so the average of the scaled shares is their sum. Ranks
with fewer pieces run weight-0 pieces so that every rank runs the same number of forwards and
backwards: FSDP's collectives must line up or they hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from services.core.config.run import AlgoSection
from services.rl.batch import Rollout
from services.rl.micro import MicroBatch
from services.rl.trainer import SplitFn, is_max, micro_plan


def rank_split(rank: int, world: int) -> SplitFn:
    """The `split` of rank `rank` of `world` (see the module doc)."""

    def split(mb: Rollout, algo: AlgoSection) -> list[MicroBatch]:
        n = len(mb)
        m = mb.response_mask.bool()
        units = m.sum(dim=1) if algo.loss_agg == "token_mean" else m.any(dim=1).long()
        total = int(units.sum())
        # Every rank plans every slice (each holds the whole batch), so all agree on the piece count;
        # each slice is cut as the one-rank trainer cuts (row count or token budget, packed or not).
        plans = [[(idx[p.rows], p) for p in micro_plan(mb.select(idx), algo)] if len(idx) else []
                 for idx in torch.arange(n).tensor_split(world)]
        pieces = max(max(len(p) for p in plans), 1)
        out: list[MicroBatch] = []
        for rows, p in plans[rank]:
            # No loss units anywhere: the loss is zero whatever the weights; share by rows.
            w = int(units[rows].sum()) / total if total else len(rows) / n
            out.append(MicroBatch(rows, w * world, p.trim, p.bins))
        filler = MicroBatch(torch.zeros(1, dtype=torch.long), 0.0)  # any row: its weight 0 adds nothing
        return out + [filler] * (pieces - len(out))

    return split


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one (the classes transformers never splits), found
    in `model` or in the backbone a value model wraps."""
    target = getattr(model, "backbone", model)
    names = set(getattr(target, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 over the default process group: each block its own unit, the rest in the root's. bf16
    compute with float32 gradient reduction on CUDA; the CPU keeps the model's own dtype."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for block in blocks(model):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    assert isinstance(model, FSDPModule)
    if hasattr(model, "values"):
        # The value model is called through values(), not forward(): FSDP must gather around it too.
        register_fsdp_forward_method(model, "values")
    return model


def reduce_stats(stats: dict[str, float], world: int) -> dict[str, float]:
    """The global step's statistics: the mean over the ranks, since each rank's are its share
    times `world` (the trainer weights them by the piece weights) or, like grad_norm, the same on
    every rank; a maximum (`*_max`) is the largest rank's. Collectives: every rank calls it with the
    same keys, which the same op on the same batch guarantees."""
    out: dict[str, float] = {}
    for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in stats if not is_max(k))),
                     (dist.ReduceOp.MAX, sorted(k for k in stats if is_max(k)))):
        if not keys:
            continue
        t = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        scale = world if op == dist.ReduceOp.SUM else 1
        out.update({k: float(v) / scale for k, v in zip(keys, t.tolist(), strict=True)})
    return out
