"""Packed forwards: sequences laid end to end in rows, results back in the rollout layout `[B, R]`.

Each sequence is its real prompt tokens then its real response tokens (no left padding), so a row is
as wide as what it holds. With one sequence per row this is a right-padded batch under a plain causal
mask. With several, no attention code here either: the row goes in with `attention_mask=None` and
position ids restarting at 0 at each sequence, from which transformers' mask construction
(`masking_utils.find_packed_sequence_indices`) builds a causal mask that never crosses a sequence, for
sdpa and eager alike. A model whose mask ignored position ids would silently attend across sequences,
which is why tests/unit/test_rl_packing.py compares packed and unpacked results on the model families
used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.models.nets.critic import ValueModel
from services.models.nets.logprobs import accepts_kwarg, token_logprobs
from services.rl.batch import Rollout


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # [N, W]
    position_ids: torch.Tensor  # [N, W], restarting at 0 at every sequence; the padding tail runs on
    src_row: torch.Tensor  # [K] packed row of the position predicting each real response token
    src_col: torch.Tensor  # [K] its column
    dst_row: torch.Tensor  # [K] that token's rollout row
    dst_col: torch.Tensor  # [K] its response column
    targets: torch.Tensor  # [K] the token ids


def pack_rows(r: Rollout, bins: list[list[int]], pad_id: int = 0) -> PackedRows:
    """Lay rows of `r` end to end, `bins[k]` in packed row k: each sequence is its real prompt tokens
    then its real response tokens; response token t is predicted at the column before it."""
    seqs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    for b in bins:
        row = []
        for i in b:
            pm, rm = r.prompt_mask[i].bool(), r.response_mask[i].bool()
            if rm.any() and not pm.any():
                raise ValueError(f"row {i} has a response but an empty prompt: nothing predicts its first token")
            row.append((r.prompt_ids[i][pm], r.response_ids[i][rm], rm.nonzero().squeeze(1)))
        seqs.append(row)
    width = max(max((sum(len(p) + len(q) for p, q, _ in row) for row in seqs), default=0), 1)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    src_row, src_col, dst_row, dst_col, tgt = [], [], [], [], []
    for k, (b, row) in enumerate(zip(bins, seqs, strict=True)):
        col = n = 0
        for i, (p, q, cols) in zip(b, row, strict=True):
            n = len(p) + len(q)
            ids[k, col : col + n] = torch.cat([p, q])
            pos[k, col : col + n] = torch.arange(n)
            src_row.append(torch.full((len(q),), k, dtype=torch.long))
            src_col.append(torch.arange(len(q)) + col + len(p) - 1)
            dst_row.append(torch.full((len(q),), i, dtype=torch.long))
            dst_col.append(cols)
            tgt.append(q)
            col += n
        # The tail continues the last sequence (causal: nothing real attends to it), so a row holding
        # one sequence is no packed row to transformers, which keeps sdpa's plain causal path.
        pos[k, col:] = torch.arange(width - col) + n

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs).long() if xs else torch.zeros(0, dtype=torch.long)

    return PackedRows(ids, pos, cat(src_row), cat(src_col), cat(dst_row), cat(dst_col), cat(tgt))


def _scatter(rows: PackedRows, vals: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape, dtype=vals.dtype, device=vals.device)
    return out.index_put((rows.dst_row.to(vals.device), rows.dst_col.to(vals.device)), vals)


def packed_logprobs(
    model: nn.Module, r: Rollout, bins: list[list[int]], temperature: float = 1.0,
    with_entropy: bool = False, entropy_grad: bool = True, compile_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `response_logprobs` gives for `r` (`[B, R]` float32 log-probs, 0 at padding, and the
    entropy with `with_entropy`), computed on packed rows."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = pack_rows(r, bins)
    dev = r.response_ids.device
    extra: dict[str, Any] = {}
    keep = torch.unique(rows.src_col)
    # Only the columns that predict a response token go through the LM head (transformers takes a
    # tensor of columns as `logits_to_keep`); a model that ignores it returns every column.
    if len(keep) and accepts_kwarg(model, "logits_to_keep"):
        extra["logits_to_keep"] = keep.to(dev)
    logits = model(input_ids=rows.input_ids.to(dev), position_ids=rows.position_ids.to(dev),
                   attention_mask=None, use_cache=False, **extra).logits
    col = rows.src_col
    if "logits_to_keep" in extra and logits.shape[1] == len(keep):
        col = torch.searchsorted(keep, rows.src_col)
    z = logits[rows.src_row.to(dev), col.to(dev)]
    logp, entropy = token_logprobs(z, rows.targets.to(dev), temperature, with_entropy, entropy_grad, compile_backend)
    shape = r.response_ids.shape
    out = _scatter(rows, logp, shape)
    if not with_entropy:
        return out, None
    return out, _scatter(rows, entropy, shape)


def packed_values(model: ValueModel, r: Rollout, bins: list[list[int]]) -> torch.Tensor:
    """What `ValueModel.values` gives for `r` (`[B, R]` float32, 0 at padding), on packed rows: the
    value of response token t is read at the position whose logits would predict it."""
    rows = pack_rows(r, bins)
    dev = r.response_ids.device
    hidden = model.backbone(input_ids=rows.input_ids.to(dev), position_ids=rows.position_ids.to(dev),
                            attention_mask=None, use_cache=False).last_hidden_state
    v = model.value_head(hidden[rows.src_row.to(dev), rows.src_col.to(dev)].float()).squeeze(-1)
    return _scatter(rows, v, r.response_ids.shape)
