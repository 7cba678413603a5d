"""Where the vLLM backend touches vLLM's internals (pinned 0.26.0; see `vllm_engine` for the why).

- Worker-side functions, run through `LLM.collective_rpc` (in this process: the engine core is
  in-process): the sampler patch that makes "processed" log-probs `log_softmax(logits / T)` before
  top-k/top-p, one bucket of a weight sync, and the model's device and dtype.
- Our `SamplingParams` in vLLM's terms (`sampling_kwargs`).
- Reading vLLM's outputs into ours: per-token log-probs (flat or dict layout) and finish reasons.
- Start-up options in vLLM's terms: CUDA-graph capture sizes, the compile cache, our environment knobs.
- The checksums of a weight sync (`weights.check`): vLLM's parameters, fused ones mapped to their parts.

Nothing here imports vllm at module level: the backend stays importable without it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from services.models.engine import EngineError, FinishReason, SamplingParams
from services.models.weights.check import Held, sums_of, unfuse

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


def _worker(w: Any) -> Any:
    return getattr(w, "worker", None) or w


def patch_sampler(w: Any) -> str:
    """Make the sampler's "processed" log-probs `log_softmax(logits / T)` before top-k/top-p."""
    runner = _worker(w).model_runner
    sampler = getattr(runner, "sampler", None)
    if sampler is None:
        return "unpatched: no sampler"
    mod = type(sampler).__module__
    if getattr(sampler, "_rlfleet_patched", False):
        return sampler._rlfleet_patched
    orig = sampler.sample

    if mod.startswith("vllm.v1.worker.gpu.sample"):  # model runner V2 (default for dense models)
        def sample_v2(logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, idx_mapping_np: Any,
                      pos: torch.Tensor, input_ids: torch.Tensor, expanded_local_pos: torch.Tensor,
                      return_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            scored = None
            if return_logprobs:
                t = sampler.sampling_states.temperature.gpu[expanded_idx_mapping].float()
                t = torch.where(t < _GREEDY_EPS, torch.ones_like(t), t)
                scored = logits.float() / t.unsqueeze(-1)  # a new tensor: the sampler mutates `logits`
            sampled, processed = orig(logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids,
                                      expanded_local_pos, return_logprobs=return_logprobs)
            return sampled, (scored if scored is not None else processed)

        sampler.sample = sample_v2
        sampler.logprobs_mode = "processed_logprobs"  # scores (log_softmax of) what sample returns
        sampler._rlfleet_patched = "v2: log_softmax(logits/T) before top-k/top-p"
        return sampler._rlfleet_patched

    if mod.startswith("vllm.v1.sample"):  # model runner V1
        def sample_v1(logits: torch.Tensor, sampling_metadata: Any, logprobs_mode_override: Any = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
            scored = None
            if sampling_metadata.max_num_logprobs is not None:
                t = sampling_metadata.temperature
                x = logits.float()
                if t is not None:
                    t = torch.where(t < _GREEDY_EPS, torch.ones_like(t), t).float()
                    x = x / t.unsqueeze(-1)
                scored = x.log_softmax(dim=-1)
            sampled, processed = orig(logits, sampling_metadata, logprobs_mode_override)
            return sampled, (scored if scored is not None else processed)

        sampler.sample = sample_v1
        sampler.logprobs_mode = "processed_logprobs"
        sampler._rlfleet_patched = "v1: log_softmax(logits/T) before top-k/top-p"
        return sampler._rlfleet_patched
    return f"unpatched: unknown sampler {mod}.{type(sampler).__name__}"


def load_bucket(w: Any, bucket: list[tuple[str, torch.Tensor]]) -> int:
    model = _worker(w).get_model()
    with torch.inference_mode():  # vLLM may have made its parameters under inference mode
        loaded = model.load_weights(weights=iter(bucket))
    return len(loaded) if loaded is not None else len(bucket)


def held_checksums(w: Any) -> tuple[list[tuple[str, str, int, int]], dict[str, list[str]]]:
    """Worker side of `VLLMEngine.weight_checksums`: the sums (`weights.check`) of every parameter
    vLLM's model holds, under vLLM's names, and the model's map of fused modules to their parts."""
    model = _worker(w).get_model()
    named = list(model.named_parameters())  # a tied LM head is the embedding's parameter: listed once
    sums = sums_of([p for _, p in named])
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    rows = [(n, str(p.dtype).removeprefix("torch."), s1, s2) for (n, p), (s1, s2) in zip(named, sums, strict=True)]
    return rows, {str(k): [str(x) for x in v] for k, v in packed.items()}


def held_in_trainer_names(rows: list[tuple[str, str, int, int]], packed: dict[str, list[str]],
                          groups: Iterable[Sequence[str]]) -> list[Held]:
    """vLLM's parameters as made of the trainer's tensors: a fused one (qkv_proj) of its parts in
    order, each part under every name of its alias group (a tied embedding is the LM head too)."""
    alias = {n: tuple(g) for g in groups for n in g}
    return [Held(name, dtype, (s1, s2), tuple(alias.get(p, (p,)) for p in unfuse(name, packed)))
            for name, dtype, s1, s2 in rows]


def model_param_info(w: Any) -> tuple[str, str]:
    p = next(_worker(w).get_model().parameters())
    return str(p.device), str(p.dtype).removeprefix("torch.")


def sampling_kwargs(params: SamplingParams, eos: Iterable[int], seed: int) -> dict[str, Any]:
    """`vllm.SamplingParams` keyword arguments of one prompt of a generate call, `seed` its own. The
    sampled token's log-prob is asked for only with `params.logprobs`: vLLM's per-token log-prob
    output costs a large share of its decode throughput."""
    kw: dict[str, Any] = {
        "n": 1, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "max_tokens": params.max_new_tokens, "stop_token_ids": sorted(set(eos) | set(params.stop_token_ids)),
        "ignore_eos": False, "seed": seed, "detokenize": False, "skip_special_tokens": False,
    }
    if params.logprobs:
        kw.update(logprobs=0, flat_logprobs=True)  # the sampled token's log-prob only
    return kw


def sampled_logprobs(logprobs: Any, token_ids: list[int], skip_first: bool = False) -> list[float]:
    """The log-prob of each token in `token_ids` from vLLM's per-position logprobs (flat or dicts)."""
    if not token_ids[1 if skip_first else 0:]:
        return []
    if logprobs is None:
        raise EngineError("vLLM returned no log-probs although they were requested")
    out: list[float] = []
    starts = getattr(logprobs, "start_indices", None)
    for k, tok in enumerate(token_ids):
        if skip_first and k == 0:
            continue
        if starts is not None:  # FlatLogprobs
            lo, hi = logprobs.start_indices[k], logprobs.end_indices[k]
            for j in range(lo, hi):
                if logprobs.token_ids[j] == tok:
                    out.append(float(logprobs.logprobs[j]))
                    break
            else:
                raise EngineError(f"vLLM log-probs at position {k} miss token {tok}")
        else:
            entry = logprobs[k]
            if entry is None or tok not in entry:
                raise EngineError(f"vLLM log-probs at position {k} miss token {tok}")
            out.append(float(entry[tok].logprob))
    return out


def finish_reason(reason: str | None) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "abort":
        return "abort"
    return "stop"


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else raw.lower() in ("1", "true", "yes", "on")


# vLLM's default CUDA-graph decode batch sizes (0.26): 1, 2, 4, then every 8 to 256, every 16 to 512.
_VLLM_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's default capture sizes up to `max_batch`, and `max_batch` itself (the run's full batch)."""
    if max_batch < 1:
        raise EngineError(f"cudagraph_max_batch must be >= 1, got {max_batch}")
    return sorted({s for s in _VLLM_CAPTURE_SIZES if s <= max_batch} | {max_batch})


def compile_options(cudagraph_max_batch: int | None, compile_cache_dir: str | None,
                    engine_kwargs: dict[str, Any], subdir: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """`LLM(...)` keyword arguments and environment for the CUDA-graph and compile-cache options.

    The cache goes through VLLM_CACHE_ROOT rather than `compilation_config.cache_dir`: vLLM keys its
    cache by model and config hash under the root, while an explicit cache_dir is used as is (a
    changed config would then reuse stale artefacts). `subdir` (an engine replica's) goes under the
    root: the configured one, else the one vLLM itself resolves from its environment."""
    kwargs: dict[str, Any] = {}
    env: dict[str, str] = {}
    if cudagraph_max_batch is not None:
        comp = dict(engine_kwargs.get("compilation_config") or {})
        comp["cudagraph_capture_sizes"] = capture_sizes(cudagraph_max_batch)
        kwargs["compilation_config"] = comp
    if subdir is not None:
        root = compile_cache_dir or importlib.import_module("vllm.envs").VLLM_CACHE_ROOT
        compile_cache_dir = str(Path(root).expanduser() / subdir)
    if compile_cache_dir is not None:
        Path(compile_cache_dir).mkdir(parents=True, exist_ok=True)
        env["VLLM_CACHE_ROOT"] = str(Path(compile_cache_dir).resolve())
    return kwargs, env
