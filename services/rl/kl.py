"""Per-token estimators of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL
divergence", 2020).

k1 is unbiased but high-variance and can be negative; k2 is low-variance but biased; k3 is
unbiased, non-negative and low-variance, which is why it is the default in the loss. The names verl
uses are accepted too: `low_var_kl` is k3 with verl's bounds (identical to k3 here, since both are
bounded the same way), `abs` is |log pi - log ref|.

One implementation for torch tensors (the trainer's KL loss, gradients flowing) and numpy arrays
(the controller's KL-in-reward and its "kl" statistic), through `services.rl.xp`.
"""

from __future__ import annotations

from typing import Literal

from services.rl import xp
from services.rl.xp import A, acc_dtype

KLKind = Literal["k1", "k2", "k3", "low_var_kl", "abs"]
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl", "abs")

# k3 exponentiates the log-ratio. One token on which the policy has drifted far from the reference
# (or a padding slot holding an arbitrary log-prob) would give exp(>88) = inf in float32, and inf
# times a zero mask is NaN, which poisons the whole loss and every gradient. Clamping to +-20 keeps
# exp() finite; the estimate itself is then bounded by `KL_VALUE_CLAMP`.
K3_LOG_RATIO_CLAMP = 20.0

# Bound on each token's estimate, as verl (low_var_kl) and OpenRLHF (every estimator) bound it:
# even the log-ratio clamp above lets k3 reach ~5e8 on one token, which would swamp every other
# term of a loss or a reward. A token past +-10 nats carries no useful signal beyond "far away".
KL_VALUE_CLAMP = 10.0


def kl_estimate(logp: A, ref_logp: A, kind: KLKind, clamp: float | None = KL_VALUE_CLAMP) -> A:
    """Per-token KL estimate [B, R], each value bounded to [-clamp, clamp] (None: unbounded, though
    k3 stays finite); not masked (the caller masks). Gradients flow through both inputs."""
    acc = acc_dtype(logp.dtype)
    diff = xp.cast(logp, acc) - xp.cast(ref_logp, acc)  # log pi/ref
    if kind == "k1":
        out = diff
    elif kind == "k2":
        out = 0.5 * diff * diff
    elif kind in ("k3", "low_var_kl"):
        log_ratio = xp.clamp(-diff, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log ref/pi
        out = xp.expm1(log_ratio) - log_ratio  # expm1: no cancellation (or negatives) near 0
    elif kind == "abs":
        out = abs(diff)
    else:
        raise ValueError(f"unknown KL estimator {kind!r} (expected one of {', '.join(KL_KINDS)})")
    if clamp is not None:
        out = xp.clamp(out, -clamp, clamp)
    return xp.cast(out, logp.dtype)
