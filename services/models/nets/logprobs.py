"""Per-token log-probs of responses under a causal LM, in the rollout layout.

`cat(prompt_ids, response_ids)` has the prompt left-padded and the response right-padded, so every
response starts at column P. Position ids count real tokens only (`cumsum(mask) - 1`, clamped at 0
for the left padding), which makes a row's result independent of how much padding it got.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.core.config.base import ConfigError

log = logging.getLogger(__name__)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions of real tokens counted from 0 at each row's first real token; padding gets 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def accepts_kwarg(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool,
                    entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, logp.new_zeros(())
    # Detached, the entropy records nothing for autograd: no [.., V] tensor is kept for a backward.
    src = logp_all if entropy_grad and torch.is_grad_enabled() else logp_all.detach()
    return logp, -(src.exp() * src).sum(-1)


_COMPILED: dict[str, Any] = {}


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = True, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`log softmax(logits / temperature)` at `tokens` (float32, the shape of `tokens`) and, with
    `with_entropy`, the tempered distribution's entropy at each position (else a 0-d zero).

    Every log-prob path (whole vocabulary, chunked, packed) goes through this one function, so they
    agree bit for bit. With a torch.compile `backend` the vocabulary-sized steps run as fused kernels:
    eagerly, the float32 copy of the logits, the log-softmax, the entropy's terms and, in the backward,
    the dense gradient are each a pass over `[.., V]` (151,936 columns for Qwen2), about 70 bytes of
    memory traffic per logit; fused, the bf16 logits are read a few times and nothing of that size is
    kept."""
    if backend is None:
        return _token_logprobs(logits, tokens, temperature, with_entropy, entropy_grad)
    fn = _COMPILED.get(backend)
    if fn is None:
        fn = _COMPILED[backend] = torch.compile(_token_logprobs, backend=backend, dynamic=None)
    out: tuple[torch.Tensor, torch.Tensor] = fn(logits, tokens, temperature, with_entropy, entropy_grad)
    return out


def forward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep_last: int = 0,
    **kwargs: Any,
) -> torch.Tensor:
    """Logits `[B, T or keep_last, V]`; with `keep_last` > 0 only the last positions go through the
    LM head when the model supports `logits_to_keep` (the prompt's logits are never materialised)."""
    extra: dict[str, Any] = dict(kwargs)
    if keep_last > 0 and accepts_kwarg(model, "logits_to_keep"):
        extra["logits_to_keep"] = keep_last
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **extra,
    )
    logits: torch.Tensor = out.logits
    if keep_last > 0 and logits.shape[1] != keep_last:
        logits = logits[:, -keep_last:]
    return logits


@overload
def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = ...,
    with_entropy: Literal[False] = ...,
    entropy_grad: bool = ...,
    chunk_tokens: int = ...,
    compile_backend: str | None = ...,
) -> torch.Tensor: ...


@overload
def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = ...,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = ...,
    chunk_tokens: int = ...,
    compile_backend: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = ...,
    with_entropy: bool = ...,
    entropy_grad: bool = ...,
    chunk_tokens: int = ...,
    compile_backend: str | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = 0,
    compile_backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`log softmax(logits / temperature)` at each response token, `[B, R]` float32, 0 at padding.

    One forward over the whole sequence; the logits that predict response token t sit at column
    P + t - 1. Differentiable (the trainer calls it under autograd). With `with_entropy`, also the
    entropy of the same tempered distribution at each response position, `[B, R]`, 0 at padding;
    `entropy_grad=False` computes it outside autograd (a statistic only), which saves the two
    `[B, R, V]` tensors its backward would keep.

    `chunk_tokens` > 0 never builds the `[B, R, V]` logits: the LM head runs on the hidden states of
    the real response tokens only (padding skipped), `chunk_tokens` of them at a time, and under
    autograd each chunk is recomputed in the backward pass (activation checkpointing), so the
    vocabulary-sized tensors alive at any moment are `[chunk_tokens, V]`. Same numbers as the
    whole-vocabulary path; models whose logits are more than `lm_head(hidden)` fall back to it.

    `compile_backend` (torch.compile's, e.g. "inductor") fuses the vocabulary-sized steps
    (`token_logprobs`); None runs them eagerly.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if prompt_ids.shape != prompt_mask.shape or response_ids.shape != response_mask.shape:
        raise ValueError(
            f"ids/mask shapes disagree: prompt {tuple(prompt_ids.shape)} vs {tuple(prompt_mask.shape)},"
            f" response {tuple(response_ids.shape)} vs {tuple(response_mask.shape)}"
        )
    b, p = prompt_ids.shape
    r = response_ids.shape[1]
    if p == 0:
        raise ValueError("prompts must have at least one column (a response needs a context)")
    rmask = response_mask.bool()
    if r == 0:
        empty = torch.zeros(b, 0, dtype=torch.float32, device=response_ids.device)
        return (empty, empty.clone()) if with_entropy else empty
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.bool(), rmask], dim=1)
    if chunk_tokens > 0 and bool(rmask.any()):  # no real token at all: the plain path keeps the graph
        parts = split_head(model)
        if parts is not None:
            return _chunked(parts, input_ids, attention_mask, response_ids, rmask, temperature,
                            with_entropy, entropy_grad, chunk_tokens, compile_backend)
    # The last R+1 columns hold the predictions of the R response tokens (plus one past the end).
    logits = forward_logits(model, input_ids, attention_mask, keep_last=r + 1)[:, :-1]
    logp, entropy = token_logprobs(logits, response_ids, temperature, with_entropy, entropy_grad, compile_backend)
    logp = logp.masked_fill(~rmask, 0.0)
    if not with_entropy:
        return logp
    return logp, entropy.masked_fill(~rmask, 0.0)


_FALLBACK_SAID: set[str] = set()


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, lm_head) of a causal LM whose logits are exactly `lm_head(decoder(...).last_hidden_state)`,
    else None (soft-capped or scaled logits, or an unknown layout)."""
    get_dec, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    cfg = getattr(model, "config", None)
    scaled = any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale"))
    head = get_head() if callable(get_head) and not scaled else None
    decoder = get_dec() if callable(get_dec) and isinstance(head, nn.Linear) else None
    if decoder is None or decoder is model or not isinstance(head, nn.Linear):
        name = type(model).__name__
        if name not in _FALLBACK_SAID:
            _FALLBACK_SAID.add(name)
            log.info("chunked log-probs: %s is not decoder + linear head; using the whole-vocabulary path", name)
        return None
    return decoder, head


def _head_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   temperature: float, entropy: bool, entropy_grad: bool,
                   backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = nn.functional.linear(hidden, weight, bias)
    return token_logprobs(logits, tokens, temperature, entropy, entropy_grad, backend)


def _chunked(parts: tuple[nn.Module, nn.Linear], input_ids: torch.Tensor, attention_mask: torch.Tensor,
             response_ids: torch.Tensor, rmask: torch.Tensor, temperature: float, with_entropy: bool,
             entropy_grad: bool, chunk: int,
             backend: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    decoder, head = parts
    b, r = response_ids.shape
    out = decoder(input_ids=input_ids, attention_mask=attention_mask.long(),
                  position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    # Column P + t - 1 predicts response token t; only real response tokens go through the head.
    hidden = out.last_hidden_state[:, -(r + 1):-1][rmask]
    tokens = response_ids.long()[rmask]
    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], tokens[i:i + chunk], head.weight, head.bias, temperature, with_entropy,
                entropy_grad, backend)
        lp, ent = (checkpoint(_head_logprobs, *args, use_reentrant=False) if grad
                   else _head_logprobs(*args))
        lps.append(lp)
        if with_entropy:
            ents.append(ent)
    flat = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    logp = torch.zeros(b, r, dtype=flat.dtype, device=flat.device).masked_scatter(rmask, flat)
    if not with_entropy:
        return logp
    flat_e = torch.cat(ents) if ents else flat
    return logp, torch.zeros(b, r, dtype=flat_e.dtype, device=flat_e.device).masked_scatter(rmask, flat_e)


def repeated_blocks(module: nn.Module) -> nn.ModuleList | None:
    """The largest list of same-class blocks in `module` (a decoder's transformer layers), else None."""
    best: nn.ModuleList | None = None
    for sub in module.modules():
        if (isinstance(sub, nn.ModuleList) and len(sub) > 1 and len({type(b) for b in sub}) == 1
                and (best is None or len(sub) > len(best))):
            best = sub
    return best


COMPILE_BACKEND = "inductor"  # torch.compile's backend for `algo.compile` (tests swap in a counting one)


def wants_compile(flag: bool | None, device: torch.device | str, ranks: int = 1, adapters: bool = False) -> bool:
    """`algo.compile` for a model on `device` trained or scored by `ranks` processes: as set, else on
    for a full model (no LoRA `adapters`) on one CUDA device, the configuration measured on the GPU
    (see `AlgoSection.compile`)."""
    if flag is not None:
        return flag
    return torch.device(device).type == "cuda" and ranks == 1 and not adapters


def wants_tf32(flag: bool | None, device: torch.device | str) -> bool:
    """`algo.tf32` for a model on `device`: as set, else on for a CUDA device (see `AlgoSection.tf32`)."""
    return flag if flag is not None else torch.device(device).type == "cuda"


def use_tf32(flag: bool | None, device: torch.device | str) -> bool:
    """Apply `algo.tf32` to this process's CUDA fp32 matmuls (a process-wide switch: each role's
    process trains or scores one model); says whether TF32 is on. Nothing changes on the CPU."""
    if torch.device(device).type != "cuda":
        return False
    on = wants_tf32(flag, device)
    torch.set_float32_matmul_precision("high" if on else "highest")
    return on


def autocast(dtype: str | None, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """`algo.autocast`'s context for a forward pass on `device`: torch.autocast in `dtype` (its matmuls in
    that dtype, softmaxes and reductions in fp32; the backward follows the forward's casts), or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


def warm_up_compiled(role: str, warm_up: Callable[[], bool]) -> None:
    """Run a `warm_up` of compiled code (it says whether there was any to compile); a compile failure
    (no compiler for Triton, an operator Inductor cannot lower) is a ConfigError naming the way out: a
    restart would fail the same way."""
    t0 = time.perf_counter()
    try:
        if warm_up():
            log.info("compiled", extra={"role": role, "seconds": round(time.perf_counter() - t0, 1)})
    except Exception as err:
        from torch._dynamo.exc import TorchDynamoException

        if not isinstance(err, TorchDynamoException):
            raise
        raise ConfigError(f"{role}: torch.compile failed while warming up ({type(err).__name__}:"
                          f" {str(err).splitlines()[0][:300] if str(err) else ''}); algo.compile: false runs"
                          f" the model eagerly") from err


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far: a step that adds to it recompiled, which
    costs seconds on a GPU (a shape or input the warm-up did not cover)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _guard_failures() -> dict[object, int]:
    """How many guard failures Dynamo has recorded so far for each compiled code object."""
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in list(guard_failures.items())}


def _guard_failures_since(before: dict[object, int]) -> list[str]:
    """The guard failures recorded after `before` (`_guard_failures()`): why each recompile since happened.
    A recompile of an earlier code object appends to that code's list, so each list is cut on its own."""
    from torch._dynamo.utils import guard_failures

    return [r for code, reasons in list(guard_failures.items()) for r in reasons[before.get(code, 0):]]


class CompileCount:
    """The graphs torch.compile builds in this process from now on: `since(role)` says how many, and
    logs them when there are any (seconds a step spent compiling after the warm-up), with the guards
    that failed: which shape or input the warm-up missed (sizes and source lines, never values)."""

    def __init__(self) -> None:
        self.before, self.failures, self.t0 = compiled_graphs(), _guard_failures(), time.perf_counter()

    def since(self, role: str) -> int:
        n = compiled_graphs() - self.before
        if n:
            why = [r.splitlines()[0][:300] for r in _guard_failures_since(self.failures)][:8]
            log.info("compiled during a step", extra={"role": role, "graphs": n, "guard_failures": why,
                                                      "seconds": round(time.perf_counter() - self.t0, 1)})
        return n


def compile_decoder(model: nn.Module, backend: str = COMPILE_BACKEND) -> nn.Module:
    """torch.compile the transformer body of `model` in place (the module its forward and the chunked
    path both call), keeping parameter names, so state dicts and weight syncs are unchanged.

    Block by block where the body is a list of identical blocks: Dynamo compiles one block's code once
    and reuses it for every layer (its parameters are inputs, not constants), so a 28-layer model
    compiles in the time of one layer instead of 28 (PyTorch's regional compilation recipe); embedding
    and final norm stay eager, a few small kernels per forward."""
    import torch._dynamo.config as dynamo_config

    # A block's code gets a graph per grad mode (training; no-grad proximal and reference passes), per
    # mask (padded, unpadded) and per size (first shapes, dynamic, one row): 10 in a trainer that runs
    # the proximal forward, past Dynamo's default limit of 8, beyond which it runs the block eagerly
    # without a word. Frozen and trainable weights of one process (tests) take graphs of their own too.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 32)
    parts = split_head(model)
    target = parts[0] if parts is not None else model
    blocks = repeated_blocks(target)
    for block in blocks if blocks is not None else [target]:
        block.compile(dynamic=None, backend=backend)
    return target
