"""Policy, value, entropy and KL losses over the padded `[B, R]` response layout.

Inputs at padding are replaced before any exp/clamp, not just masked afterwards: a select after
the fact stops the forward NaN but not the backward one (`0 * inf` in the chain rule), so a padding
slot holding an arbitrary log-prob could otherwise turn every gradient into NaN.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, ParamSpec, get_args

import torch
from torch import Tensor

from services.core.config.algo import BehaviourCorrection
from services.rl.kl import K3_LOG_RATIO_CLAMP, KL_VALUE_CLAMP, KLKind, kl_estimate
from services.rl.masked import acc_dtype, as_bool_mask, masked_mean, masked_sum

P = ParamSpec("P")

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
RatioLevel = Literal["token", "sequence"]
_CORRECTIONS: tuple[str, ...] = get_args(BehaviourCorrection)

# Bounds on log-ratios before exp(): exp(20) ~ 5e8 is finite in float32 and far past any ratio the
# clip or the weight cap lets through, so the bound only matters for pathological tokens.
_LOG_RATIO_CLAMP = K3_LOG_RATIO_CLAMP


def _check_mode(mode: str) -> None:
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r} (expected one of {', '.join(_AGG_MODES)})")


def _check_same(like: Tensor, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != like.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != expected {tuple(like.shape)}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: AggMode, norm_len: int | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar; 0 (still attached to the graph) when nothing is masked.

    `token_mean` weights every token equally (long responses dominate); the `seq_mean_*` modes weight
    every non-empty response equally, by its mean or its sum over tokens. `seq_mean_token_sum_norm`
    (Dr. GRPO) divides each response's sum by one constant, `norm_len` (the generation budget; the
    batch's padded width when not given), so no response length rescales its own gradient.
    """
    _check_mode(mode)
    m = as_bool_mask(mask, loss_mat)
    x = loss_mat.to(acc_dtype(loss_mat.dtype))
    if mode == "token_mean":
        out = masked_mean(x, m)
    else:
        if x.dim() != 2:
            raise ValueError(f"{mode} needs a [B, R] loss, got shape {tuple(x.shape)}")
        if mode == "seq_mean_token_mean":
            per_row = masked_mean(x, m, dim=1)
        else:
            per_row = masked_sum(x, m, dim=1)
            if mode == "seq_mean_token_sum_norm":
                norm = x.shape[1] if norm_len is None else norm_len
                if norm < 1:
                    raise ValueError(f"seq_mean_token_sum_norm needs norm_len >= 1, got {norm}")
                per_row = per_row / norm
        out = masked_mean(per_row, m.any(dim=1))
    return out.to(loss_mat.dtype)


def _safe_log_ratio(num: Tensor, den: Tensor, m: Tensor) -> Tensor:
    acc = acc_dtype(num.dtype)
    diff = torch.where(m, num.to(acc) - den.to(acc), torch.zeros((), dtype=acc, device=num.device))
    return diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _sequence_log_ratio(log_ratio: Tensor, m: Tensor) -> Tensor:
    """Length-normalised sequence log-ratio (1/|y|) sum_t log r_t, broadcast to every real token."""
    per_row = masked_mean(log_ratio, m, dim=1)
    return torch.where(m, per_row[:, None].expand(m.shape), torch.zeros_like(log_ratio))


def _masked_max(x: Tensor, m: Tensor) -> Tensor:
    """Largest value of `x` where `m` is true; 0 when nothing is."""
    lowest = torch.full((), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
    top = torch.where(m, x, lowest).amax() if x.numel() else lowest
    return torch.where(m.any(), top, torch.zeros_like(top))


def behaviour_weights(
    proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
    correction: BehaviourCorrection = "token_truncate", cap: float | None = None, floor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weight of each token for the engine (behaviour) having sampled it rather than the
    proximal policy the loss clips against: w = pi_prox / pi_behaviour, without grad, 0 on padding.

    The ratio covers both why the two differ: the engine's numerics (bf16 kernels, another
    attention) and, for a stale batch, the versions between its sampling and this step.
    `token_*` takes one ratio per token; `sequence_*` one per response, the product of its tokens'
    ratios exp(sum_t log r_t) (the likelihood ratio of the whole response, as TRL), given to each of
    its tokens. `*_truncate` clamps the weight into [floor, cap]; `*_mask` keeps it where it lies in
    [floor, cap] and zeroes it outside (the token, or the response, leaves the gradient); `none`
    weights nothing. A bound left None is no bound.

    Stats (0-d tensors over real tokens): `behaviour_log_ratio_mean` and `_abs_max`, log(pi_prox /
    pi_behaviour) per token; `behaviour_weight_mean` and `behaviour_weight_max` of the weights
    applied; `behaviour_ratio_max`, the largest ratio before any bound; `behaviour_bounded_frac`,
    tokens whose weight a bound changed (truncated or masked).
    """
    _check_same(proximal_logp, behaviour_logp=behaviour_logp)
    if correction not in _CORRECTIONS:
        raise ValueError(f"unknown behaviour correction {correction!r} (expected one of {', '.join(_CORRECTIONS)})")
    if cap is not None and floor is not None and floor >= cap:
        raise ValueError(f"behaviour weight floor {floor} must be below its cap {cap}")
    with torch.no_grad():
        m = as_bool_mask(mask, proximal_logp)
        tok = _safe_log_ratio(proximal_logp, behaviour_logp, m)
        if correction.startswith("sequence"):
            per_row = masked_sum(tok, m, dim=1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
            log_w = torch.where(m, per_row[:, None].expand(m.shape), torch.zeros_like(tok))
        else:
            log_w = tok
        raw = torch.exp(log_w)
        lo = -math.inf if floor is None else floor
        hi = math.inf if cap is None else cap
        inside = (raw >= lo) & (raw <= hi)
        if correction == "none":
            w = torch.ones_like(raw)
        elif correction.endswith("truncate"):
            w = raw if floor is None and cap is None else raw.clamp(min=floor, max=cap)
        else:
            w = torch.where(inside, raw, torch.zeros_like(raw))
        w = torch.where(m, w, torch.zeros_like(w))
        bounded = m & ~inside if correction != "none" else torch.zeros_like(m)
        stats = {
            "behaviour_log_ratio_mean": masked_mean(tok, m),
            "behaviour_log_ratio_abs_max": _masked_max(tok.abs(), m),
            "behaviour_weight_mean": masked_mean(w, m),
            "behaviour_weight_max": _masked_max(w, m),
            "behaviour_ratio_max": _masked_max(raw, m),
            "behaviour_bounded_frac": masked_mean(bounded.to(tok.dtype), m),
        }
    return w.to(proximal_logp.dtype), stats


def policy_loss_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    agg: AggMode = "token_mean",
    behaviour_logp: Tensor | None = None,
    behaviour_weight_cap: float | None = None,
    ratio_level: RatioLevel = "token",
    dual_clip_c: float | None = None,
    norm_len: int | None = None,
    behaviour_correction: BehaviourCorrection = "token_truncate",
    behaviour_weight_floor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate against the proximal policy `old_logp`; decoupled when given a behaviour:
    each token's loss is then weighted by `behaviour_weights(old_logp, behaviour_logp, ...)`.

    `ratio_level="sequence"` is GSPO: every token of a response carries the length-normalised
    sequence ratio s = exp(mean_t log r_t), written so its gradient is s * grad log pi per token.
    `dual_clip_c` (> 1) bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO), so a
    huge ratio on a bad token cannot dominate the step.

    Stats: `clip_frac` (tokens whose gradient the clip removes), `approx_kl` (k3 estimate of
    KL(old || new) from tokens sampled by old: r - 1 - log r), `ratio_mean`, `dual_clip_frac`
    (with dual clip), `behaviour_weight_mean` (1.0 when not decoupled) and, decoupled, the other
    stats of `behaviour_weights`. Means are over masked tokens, 0 if none; `*_max` are maxima. They
    are 0-d tensors on the loss's device: a trainer that sums them over micro-batches reads them back
    once a step (each read of a GPU value waits for the GPU); `policy_loss` gives them as floats.
    """
    _check_mode(agg)
    _check_same(logp, old_logp=old_logp, advantages=advantages, behaviour_logp=behaviour_logp)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    m = as_bool_mask(mask, logp)
    acc = acc_dtype(logp.dtype)
    tok_log_ratio = _safe_log_ratio(logp, old_logp.detach(), m)
    if ratio_level == "sequence":
        seq = _sequence_log_ratio(tok_log_ratio, m).detach()
        lp = logp.to(acc)
        # The value is the sequence ratio; the gradient flows through each token's own log-prob.
        log_ratio = torch.where(m, seq + lp - lp.detach(), torch.zeros_like(seq))
    else:
        log_ratio = tok_log_ratio
    ratio = torch.exp(log_ratio)
    adv = torch.where(m, advantages.detach().to(acc), torch.zeros((), dtype=acc, device=logp.device))
    high = clip_eps if clip_eps_high is None else clip_eps_high
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv
    loss_mat = -torch.minimum(surr, surr_clipped)
    dual_hit: Tensor | None = None
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual_hit = (adv < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual_hit, bound, loss_mat)
    weight: Tensor | None = None
    behaviour_stats: dict[str, Tensor] = {}
    if behaviour_logp is not None:
        weight, behaviour_stats = behaviour_weights(old_logp.detach(), behaviour_logp, m, behaviour_correction,
                                                    behaviour_weight_cap, behaviour_weight_floor)
        weight = weight.to(acc)
        loss_mat = loss_mat * weight
    loss = aggregate(loss_mat, m, agg, norm_len).to(logp.dtype)

    with torch.no_grad():
        clipped = ((ratio > 1.0 + high) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        approx_kl = torch.expm1(tok_log_ratio) - tok_log_ratio  # k3 of KL(old || new): r - 1 - log r
        parts = [
            masked_mean(clipped.to(acc), m),
            masked_mean(approx_kl, m),
            masked_mean(ratio, m),
        ]
        if dual_hit is not None:
            parts.append(masked_mean(dual_hit.to(acc), m))
    stats = {"clip_frac": parts[0], "approx_kl": parts[1], "ratio_mean": parts[2],
             "behaviour_weight_mean": torch.ones((), dtype=acc, device=logp.device)}
    if dual_hit is not None:
        stats["dual_clip_frac"] = parts[3]
    stats.update({k: v.to(acc) for k, v in behaviour_stats.items()})
    return loss, stats


def _stats_read_back(fn: Callable[P, tuple[Tensor, dict[str, Tensor]]]) -> Callable[P, tuple[Tensor, dict[str, float]]]:
    """`fn` with its 0-d tensor stats read back as floats, all in one transfer."""

    @functools.wraps(fn)
    def read(*args: P.args, **kwargs: P.kwargs) -> tuple[Tensor, dict[str, float]]:
        loss, stats = fn(*args, **kwargs)
        return loss, dict(zip(stats, torch.stack(list(stats.values())).tolist(), strict=True))

    return read


policy_loss = _stats_read_back(policy_loss_terms)


def value_loss_terms(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None,
    agg: AggMode = "token_mean",
    norm_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss 0.5 * max((v - R)^2, (v_clipped - R)^2); unclipped when `clip` is None.

    Clipping around the values the rollout was scored with keeps one critic step from moving far
    on a batch it has already fitted. Stats, as 0-d tensors on the values' device (`value_loss` reads
    them back): `vf_clip_frac` (tokens where the clipped term wins and the gradient is cut),
    `value_mean` (over masked tokens).
    """
    _check_mode(agg)
    _check_same(values, old_values=old_values, returns=returns)
    m = as_bool_mask(mask, values)
    acc = acc_dtype(values.dtype)
    zero = torch.zeros((), dtype=acc, device=values.device)
    v = values.to(acc)
    target = returns.detach().to(acc)
    err = torch.where(m, v - target, zero)
    vf = err * err
    if clip is None:
        loss_mat = 0.5 * vf
        clipped = torch.zeros_like(m)
    else:
        old = old_values.detach().to(acc)
        delta = torch.where(m, v - old, zero).clamp(-clip, clip)
        err_clipped = torch.where(m, old + delta - target, zero)
        vf_clipped = err_clipped * err_clipped
        loss_mat = 0.5 * torch.maximum(vf, vf_clipped)
        clipped = m & (vf_clipped > vf)
    loss = aggregate(loss_mat, m, agg, norm_len).to(values.dtype)
    with torch.no_grad():
        return loss, {"vf_clip_frac": masked_mean(clipped.to(acc), m), "value_mean": masked_mean(v, m)}


value_loss = _stats_read_back(value_loss_terms)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last axis, as logsumexp(z) - sum(p * z).

    Computed as -sum(p * log p) with log p = z - logsumexp(z): the same quantity without the
    cancellation of two large terms, and with vocabulary entries masked to -inf contributing 0
    (not 0 * -inf = NaN) in both the forward and the backward pass.
    """
    z = logits.to(acc_dtype(logits.dtype))
    # Entropy is shift-invariant: subtracting the (detached) max is exact for the large logits and
    # leaves logsumexp a small number, so log p keeps full precision even for logits ~1e4.
    z = z - z.amax(dim=-1, keepdim=True).detach()
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    p = logp.exp()
    logp_safe = torch.where(p > 0, logp, torch.zeros_like(logp))
    return (-(p * logp_safe).sum(dim=-1)).to(logits.dtype)


def kl_loss(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: KLKind, agg: AggMode,
    clamp: float | None = KL_VALUE_CLAMP, norm_len: int | None = None,
) -> Tensor:
    """KL-in-loss penalty: the aggregated per-token estimate, gradients through `logp` only."""
    _check_mode(agg)
    _check_same(logp, ref_logp=ref_logp)
    m = as_bool_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(m, logp, zero)
    ref = torch.where(m, ref_logp.detach().to(logp.dtype), zero)
    return aggregate(kl_estimate(lp, ref, kind, clamp), m, agg, norm_len)
