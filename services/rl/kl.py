"""Per-token estimators of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL
divergence", 2020).

k1 is unbiased but high-variance and can be negative; k2 is low-variance but biased; k3 is
unbiased, non-negative and low-variance, which is why it is the default.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from services.rl.masked import acc_dtype

KLKind = Literal["k1", "k2", "k3"]

# k3 exponentiates the log-ratio. One token on which the policy has drifted far from the reference
# (or a padding slot holding an arbitrary log-prob) would give exp(>88) = inf in float32, and inf
# times a zero mask is NaN, which poisons the whole loss and every gradient. Clamping to +-20 keeps
# exp() below ~5e8, far beyond any ratio that carries a useful signal, at the cost of a zero
# gradient on those (already pathological) tokens.
K3_LOG_RATIO_CLAMP = 20.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLKind) -> Tensor:
    """Per-token KL estimate [B, R]; not masked (the caller masks). Gradients flow through both."""
    acc = acc_dtype(logp.dtype)
    diff = logp.to(acc) - ref_logp.to(acc)  # log pi/ref
    if kind == "k1":
        out = diff
    elif kind == "k2":
        out = 0.5 * diff * diff
    elif kind == "k3":
        log_ratio = (-diff).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log ref/pi
        out = torch.expm1(log_ratio) - log_ratio  # expm1: no cancellation (or negatives) near 0
    else:
        raise ValueError(f"unknown KL estimator {kind!r} (expected 'k1', 'k2' or 'k3')")
    return out.to(logp.dtype)
