"""Micro-batches of a minibatch: a fixed number of rows, or a token budget, optionally packed.

A token-budget micro-batch holds sequences of similar real length (longest first, so a budget too
large for the device fails on the first forward, not the last), each laid out as its real prompt
then its real response, right-padded to the micro-batch's longest sequence (`services/rl/packing.py`
with one sequence per row): padding costs what the lengths in it differ by, not what the rollout's
widest prompt plus its widest response set. Packed micro-batches go further: several sequences share
a row.

Every plan carries each micro-batch's share of the minibatch loss, so that the accumulated gradient
equals the whole minibatch's: its share of the masked tokens (`token_mean`) or of the non-empty
responses (`seq_mean_*`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise

import torch

from services.rl.batch import Rollout

log = logging.getLogger("rlfleet.rl.micro")

_PER_TOKEN = ("response_ids", "response_mask", "behaviour_logprobs", "ref_logprobs", "values", "advantages",
              "returns")
_said_oversize = False


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor  # indices into the minibatch
    weight: float  # this micro-batch's share of the minibatch loss
    trim: bool = False  # cut to its own width before the forward
    bins: list[list[int]] | None = None  # token budget: positions in `rows` sharing each forward row


def real_lengths(r: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Real prompt and response tokens of every row (from the masks)."""
    return r.prompt_mask.bool().sum(1), r.response_mask.bool().sum(1)


def trim(r: Rollout) -> Rollout:
    """The same rows cut to their own width, keeping the layout: the prompt columns left of the
    first real prompt token and the response columns right of the last real response token go,
    so responses still start at the first response column. At least one column of each stays."""
    pm, rm = r.prompt_mask.bool(), r.response_mask.bool()
    p_cols = pm.any(0).nonzero()
    p0 = int(p_cols.min()) if len(p_cols) else pm.shape[1] - 1
    r_cols = rm.any(0).nonzero()
    r1 = int(r_cols.max()) + 1 if len(r_cols) else 1
    p0, r1 = min(p0, pm.shape[1] - 1), min(max(r1, 1), rm.shape[1])
    kw = {name: getattr(r, name)[:, :r1] for name in _PER_TOKEN if getattr(r, name) is not None}
    return replace(r, prompt_ids=r.prompt_ids[:, p0:], prompt_mask=r.prompt_mask[:, p0:], **kw)


def _say_oversize(length: int, budget: int) -> None:
    global _said_oversize
    if not _said_oversize:
        _said_oversize = True
        log.warning("a sequence is longer than the micro-batch token budget: it gets a micro-batch of its own"
                    " (said once)", extra={"tokens": length, "micro_batch_tokens": budget})


# Above this many rows the exact partition's n x n tables cost more than the padding they save.
_EXACT_MAX_ROWS = 512


def budget_groups(lengths: torch.Tensor, budget: int) -> list[list[int]]:
    """Rows longest first, in as few micro-batches as `budget` allows (rows x the group's longest
    length <= budget; filling each group in turn gets the fewest), and among the ways to cut the
    sorted rows into that many, the one computing the fewest padded tokens (a small dynamic
    programme, for up to _EXACT_MAX_ROWS rows; greedy filling beyond)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    ln = lengths[order].clamp(min=1).tolist()
    n = len(ln)
    if n and ln[0] > budget:
        _say_oversize(int(ln[0]), budget)
    starts = [0]
    for i in range(1, n):
        if (i - starts[-1] + 1) * ln[starts[-1]] > budget:
            starts.append(i)
    k = len(starts)
    if k > 1 and n <= _EXACT_MAX_ROWS:
        starts = _fewest_padded(torch.tensor(ln, dtype=torch.float64), budget, k)
    bounds = [*starts, n]
    idx = order.tolist()
    return [idx[a:b] for a, b in pairwise(bounds)]


def _fewest_padded(ln: torch.Tensor, budget: int, k: int) -> list[int]:
    """Start positions of `k` contiguous groups of the descending lengths `ln` minimising the slots
    computed, sum of rows x first length, with each group within `budget` (or a single row)."""
    n = len(ln)
    s = torch.arange(n)[:, None]
    i = torch.arange(n + 1)[None, :]
    cost = (i - s) * ln[:, None]  # group [s, i) computes (i - s) rows of ln[s] slots
    ok = (i > s) & ((cost <= budget) | (i - s == 1))
    cost = torch.where(ok, cost, torch.full_like(cost, float("inf")))
    f = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    f[0] = 0.0
    choice = []
    for _ in range(k):
        best, arg = (f[:n, None] + cost).min(dim=0)
        f = torch.cat([torch.full((1,), float("inf"), dtype=torch.float64), best[1:]])
        choice.append(arg)
    starts, end = [], n
    for arg in reversed(choice):
        end = int(arg[end])
        starts.append(end)
    return starts[::-1]


def pack_groups(lengths: torch.Tensor, budget: int) -> list[tuple[list[int], list[list[int]]]]:
    """First-fit-decreasing into rows as wide as the longest sequence (so no row attends over more
    than the unpacked batch's widest one), `budget // width` rows per micro-batch. Each group is its
    rows and, per packed row, the positions in those rows that share it."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    if not order:
        return []
    width = max(int(lengths[order[0]]), 1)
    if width > budget:
        _say_oversize(width, budget)
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        slot = next((b for b, f in enumerate(free) if f >= n), None)
        if slot is None:
            bins.append([i])
            free.append(width - n)
        else:
            bins[slot].append(i)
            free[slot] -= n
    per = max(budget // width, 1)
    out = []
    for k in range(0, len(bins), per):
        rows = [i for b in bins[k : k + per] for i in b]
        pos = {i: j for j, i in enumerate(rows)}
        out.append((rows, [[pos[i] for i in b] for b in bins[k : k + per]]))
    return out


def plan(mb: Rollout, agg: str, size: int = 0, tokens: int = 0, pack: bool = False) -> list[MicroBatch]:
    """The micro-batches of `mb`: `tokens` > 0 is a token budget (packed with `pack`), else `size`
    rows each (0: the whole minibatch), each with its loss weight."""
    n = len(mb)
    bins: list[list[list[int]] | None]
    if tokens > 0:
        plen, rlen = real_lengths(mb)
        if pack:
            packed = pack_groups(plen + rlen, tokens)
            chunks = [torch.tensor(rows, dtype=torch.long) for rows, _ in packed]
            bins = [b for _, b in packed]
        else:
            chunks = [torch.tensor(g, dtype=torch.long) for g in budget_groups(plen + rlen, tokens)]
            bins = [[[j] for j in range(len(g))] for g in chunks]
    else:
        step = size if 0 < size < n else n
        chunks = [torch.arange(i, min(i + step, n)) for i in range(0, n, step)]
        bins = [None] * len(chunks)
    cut = tokens > 0
    if len(chunks) == 1:
        return [MicroBatch(chunks[0], 1.0, cut, bins[0])]
    m = mb.response_mask.bool()
    units = m.sum(dim=1) if agg == "token_mean" else m.any(dim=1).long()
    total = int(units.sum())
    return [MicroBatch(c, int(units[c].sum()) / total if total else 1.0 / len(chunks), cut, b)
            for c, b in zip(chunks, bins, strict=True)]


def part_of(mb: Rollout, m: MicroBatch) -> Rollout:
    """The rows of one micro-batch, cut to their own width when the plan says so."""
    part = mb.select(m.rows)
    return trim(part) if m.trim else part


def score_rows(
    r: Rollout, device: torch.device, plain: Callable[[Rollout], torch.Tensor],
    packed: Callable[[Rollout, list[list[int]]], torch.Tensor],
    size: int = 0, tokens: int = 0, pack: bool = False,
) -> torch.Tensor:
    """A per-token score `[B, R]` float32 (0 at padding) computed micro-batch by micro-batch: `plain`
    on a rollout, `packed` on a rollout and its packed rows."""
    out = torch.zeros(r.response_ids.shape, dtype=torch.float32)
    for m in plan(r, "token_mean", size, tokens, pack):
        part = part_of(r, m).to(device)
        v = plain(part) if m.bins is None else packed(part, m.bins)
        out[m.rows, : v.shape[1]] = v.detach().float().cpu()
    return out
