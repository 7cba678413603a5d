"""`VLLMEngine`: vLLM (pinned 0.26.0) as the generation engine, in this process, on one GPU.

The engine keeps the contract of `services.models.engine` (the transformers backend is the reference):

- Prompts go in as token ids (`TokensPrompt`); vLLM runs with `skip_tokenizer_init=True`, so no hub
  tokenizer is ever built (transformers 5 rebuilds a wrong byte-level tokenizer for our qwen2 dirs).
- Stop handling: the EOS ids (tokenizer, config and generation config) plus `params.stop_token_ids` go
  to vLLM as `stop_token_ids`; vLLM keeps the stop token in `token_ids` and reports its log-prob, like
  our EOS convention. `ignore_eos` stays False; `max_tokens = max_new_tokens` is an exact cap.
- Log-probs are `log_softmax(logits / temperature)` over the full vocabulary, BEFORE top-k/top-p, which
  is what the trainer recomputes. vLLM 0.26 has no `logprobs_mode` for that: `raw_logprobs` (its
  default) is `log_softmax(logits)` before temperature, and `processed_logprobs` is taken after
  temperature AND after top-k/top-p (renormalised over the kept tokens). The two agree with ours only at
  temperature 1 (raw) or without top-k/top-p (processed). So the engine runs in `processed_logprobs`
  mode and wraps the worker's sampler (`vllm_adapter.patch_sampler`) so that the "processed" tensor it scores is
  `logits.float() / temperature` taken before any filtering (greedy rows: `logits.float()`). Sampling
  itself is untouched. `scoring` in `describe()` says which path is active.
- Sampling is seeded per request: row i of a call gets the contract's row seed (`params.seed_of(i)`) in
  vLLM's seed range, so the same prompts, params and weights give the same completions, and the copies
  of one prompt in a GRPO group differ.
- The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `update_weights` hands
  tensors to the model's own `load_weights` by reference (no serialisation), bucket by bucket, then
  resets the prefix cache: KV blocks cached under the old weights would otherwise be reused for prompts
  that share a prefix, and those tokens would be scored with stale keys and values.
- pause/resume/abort as in the transformers backend; `abort()` cancels the vLLM requests of the calls
  in flight (between engine steps) and they return what they generated with finish_reason "abort".
- A request reports once, when it finishes (`RequestOutputKind.FINAL_ONLY`, as `LLM.generate` asks):
  streaming every token of every request (DELTA) builds a `RequestOutput` per request per decode step
  in the one thread that also schedules the GPU, and a step of a small model is paced by that thread.
  An aborted request's tokens are read from vLLM's output state before the abort drops it.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from services.models.engine import (
    Completion,
    EngineError,
    EngineUnavailable,
    FinishReason,
    SamplingParams,
    WeightsTorn,
    check_prompts,
)
from services.models.engines.gate import CallGate
from services.models.engines.vllm_adapter import (
    compile_options,
    env_bool,
    env_float,
    finish_reason,
    held_checksums,
    held_in_trainer_names,
    load_bucket,
    model_param_info,
    patch_sampler,
    sampled_logprobs,
    sampling_kwargs,
)
from services.models.weights.check import Held
from services.models.weights.sync import (
    alias_expand,
    check_version,
    check_weights,
    shapes_only,
    stream_complete,
    unique_named,
)

log = logging.getLogger(__name__)

VLLM_VERSION = "0.26.0"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.35  # colocated with a trainer on one GPU: leave it the rest
DEFAULT_SYNC_BUCKET_MB = 512
_SEED_MOD = 2**31 - 1


def vllm_unavailable_reason() -> str | None:
    """None when vLLM and a CUDA device are there, else why the backend cannot run here."""
    if importlib.util.find_spec("vllm") is None:
        return ("generation engine 'vllm' needs the 'vllm' package, which is not importable here"
                f" (install it with: pip install 'rlfleet[vllm]' (vllm=={VLLM_VERSION}), or use engine: transformers)")
    if not torch.cuda.is_available():
        return "generation engine 'vllm' needs a CUDA GPU, and torch sees none here (use engine: transformers)"
    return None


def _import_vllm() -> Any:
    # In-process engine core: weight sync passes tensors by reference and the sampler patch applies
    # to the worker in this process. Must be set before vllm reads its environment.
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        log.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: the vLLM engine runs in-process",
                    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
    except ImportError as e:
        raise EngineUnavailable(f"generation engine 'vllm' could not import vllm: {e}") from e
    if getattr(vllm, "__version__", "") != VLLM_VERSION:
        log.warning("vLLM %s found; this backend is written and verified against %s",
                    getattr(vllm, "__version__", "?"), VLLM_VERSION)
    return vllm


def vllm_seed(params: SamplingParams, row: int) -> int:
    """The vLLM seed of row `row` of a generate call: the contract's row seed, in vLLM's range."""
    return params.seed_of(row) % _SEED_MOD


# -- expected parameters (strict weight sync) ------------------------------------------------------
def expected_parameters(model_path: Path) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """Names and shapes of the transformers model's state dict, and its alias groups (tied tensors),
    from the config alone (meta device: no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    return {n: tuple(t.shape) for n, t in state.items()}, list(groups.values())


def _eos_ids(model_path: Path) -> list[int]:
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v if isinstance(x, int))

    for fname in ("generation_config.json", "config.json"):
        f = model_path / fname
        if f.is_file():
            add(json.loads(f.read_text()).get("eos_token_id"))
    if (model_path / "tokenizer.json").is_file() or (model_path / "tokenizer_config.json").is_file():
        try:
            from services.models.io.loading import load_tokenizer

            eos = load_tokenizer(model_path).eos_token_id
            if eos is not None:
                ids.insert(0, int(eos))
        except Exception as e:  # a model dir without a loadable tokenizer still has config EOS ids
            log.debug("no tokenizer EOS for %s: %s", model_path, e)
    return list(dict.fromkeys(ids))


class VLLMEngine:
    """vLLM's `LLMEngine`, driven step by step from `generate`. Thread-safe like the transformers
    backend: generate, pause, resume, abort and update_weights may come from different threads (one
    generate drives the engine at a time; others queue behind it)."""

    def __init__(
        self,
        llm: Any,
        model_path: Path,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        expected: dict[str, tuple[int, ...]],
        alias_groups: list[list[str]],
        *,
        sync_bucket_mb: int = DEFAULT_SYNC_BUCKET_MB,
        version: int = 0,
        options: dict[str, Any] | None = None,
    ):
        if not eos_token_ids:
            raise EngineError(f"model at {model_path} has no EOS token (tokenizer, config nor generation_config)")
        self._vllm = _import_vllm()
        self._llm = llm
        self._path = Path(model_path)
        self._eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self._vocab = int(vocab_size)
        self._expected = expected
        self._groups = alias_groups
        self._bucket_bytes = max(1, int(sync_bucket_mb)) * 2**20
        self._version = version
        self._options = dict(options or {})
        self._gate = CallGate()
        self._engine_lock = threading.Lock()  # one driver of the vLLM engine at a time
        self._calls = 0
        self.last_sync: dict[str, float] = {}
        self._scoring = self._llm.collective_rpc(patch_sampler)[0]
        self._device, self._dtype = self._llm.collective_rpc(model_param_info)[0]
        if not self._scoring.startswith(("v1", "v2")):
            log.warning("vLLM sampler not patched (%s): log-probs are exact only at temperature 0 or 1"
                        " without top-k/top-p", self._scoring)

    @classmethod
    def from_path(
        cls,
        path: Path,
        *,
        dtype: str = "bfloat16",
        device: str = "cuda",
        micro_batch: int = 0,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        attention_backend: str | None = None,
        sync_bucket_mb: int = DEFAULT_SYNC_BUCKET_MB,
        seed: int = 0,
        cudagraph_max_batch: int | None = None,
        compile_cache_dir: str | None = None,
        compile_cache_subdir: str | None = None,
        **engine_kwargs: Any,
    ) -> VLLMEngine:
        """Start vLLM on the model directory `path` (a transformers directory with safetensors).

        `gpu_memory_utilization` (default 0.35, env RLFLEET_VLLM_GPU_MEMORY_UTILIZATION) is the share of
        the GPU vLLM takes for weights, activations and KV cache; `enforce_eager` (default False, env
        RLFLEET_VLLM_ENFORCE_EAGER) skips torch.compile and CUDA graphs (fast start, slower decode);
        env RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES fixes the KV cache size instead of profiling for it.
        `micro_batch` > 0 caps the sequences per engine step (`max_num_seqs`). `device` must be a CUDA
        device; pick the GPU with CUDA_VISIBLE_DEVICES. `cudagraph_max_batch`, `compile_cache_dir`
        and `compile_cache_subdir`: see `compile_options`.
        """
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)
        if str(device) not in ("cuda", "cuda:0"):
            if str(device).startswith("cuda"):
                raise EngineError(f"generation engine 'vllm' runs on the first visible GPU; got device {device!r}:"
                                  " choose the GPU with CUDA_VISIBLE_DEVICES instead")
            log.info("generation engine 'vllm' runs on CUDA; device %r ignored", device)
        if micro_batch < 0:
            raise EngineError(f"micro_batch must be >= 0 (0 = vLLM's default), got {micro_batch}")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise EngineError(f"model directory {path} has no config.json")
        comp_kwargs, comp_env = compile_options(cudagraph_max_batch, compile_cache_dir, engine_kwargs,
                                                compile_cache_subdir)
        os.environ.update(comp_env)  # before vllm reads its environment; one engine per process
        vllm = _import_vllm()
        util = gpu_memory_utilization if gpu_memory_utilization is not None else env_float(
            "RLFLEET_VLLM_GPU_MEMORY_UTILIZATION", DEFAULT_GPU_MEMORY_UTILIZATION)
        eager = enforce_eager if enforce_eager is not None else env_bool("RLFLEET_VLLM_ENFORCE_EAGER", False)
        expected, groups = expected_parameters(path)
        kwargs: dict[str, Any] = dict(
            model=str(path),
            skip_tokenizer_init=True,
            dtype=dtype,
            gpu_memory_utilization=util,
            enforce_eager=eager,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",  # see the module docstring and patch_sampler
            seed=seed,
            disable_log_stats=True,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kv_bytes = os.environ.get("RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES")
        if kv_bytes and "kv_cache_memory_bytes" not in engine_kwargs:
            # A fixed KV cache size skips vLLM's memory profiling (needed when other processes
            # allocate on the same GPU while this engine starts).
            kwargs["kv_cache_memory_bytes"] = int(float(kv_bytes))
        if micro_batch > 0:
            kwargs["max_num_seqs"] = micro_batch
        if attention_backend:
            kwargs["attention_config"] = {"backend": attention_backend}
        kwargs.update(engine_kwargs)
        kwargs.update(comp_kwargs)
        from services.models.io.loading import model_vocab_size  # transformers: not on backends' probe path

        t0 = time.perf_counter()
        llm = vllm.LLM(**kwargs)
        log.info("vLLM engine: %s (%s, util %.2f, eager %s) started in %.1fs", path, dtype, util, eager,
                 time.perf_counter() - t0)
        return cls(llm, path, _eos_ids(path), model_vocab_size(path), expected, groups,
                   sync_bucket_mb=sync_bucket_mb, options={k: v for k, v in kwargs.items() if k != "model"} | comp_env)

    # -- state ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def in_flight(self) -> int:
        return self._gate.in_flight

    @property
    def alive(self) -> bool:
        return self._llm is not None  # until close()

    @property
    def llm(self) -> Any:
        return self._llm

    def describe(self) -> dict[str, Any]:
        return {"engine": "vllm", "vllm_version": getattr(self._vllm, "__version__", "?"),
                "model": str(self._path), "device": self._device, "dtype": self._dtype,
                "scoring": self._scoring, "version": self._version, **self._options}

    def pause(self) -> None:
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def abort(self) -> None:
        self._gate.abort()

    # -- generation ----------------------------------------------------------------------------
    def sampling_params(self, params: SamplingParams, row: int) -> Any:
        from vllm.sampling_params import RequestOutputKind

        seed = vllm_seed(params, row)  # a replica slice seeds as the whole call
        return self._vllm.SamplingParams(**sampling_kwargs(params, self._eos, seed),
                                         output_kind=RequestOutputKind.FINAL_ONLY)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        check_prompts(prompts, self._vocab, params)
        with self._gate.call() as epoch, self._engine_lock:
            if self._gate.aborted(epoch):
                return [Completion([], [], "abort") for _ in prompts]
            return self._run(prompts, [self.sampling_params(params, i) for i in range(len(prompts))], epoch)

    def _run(self, prompts: list[list[int]], vparams: list[Any], epoch: int) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        engine = self._llm.llm_engine
        self._calls += 1
        ids = [f"rlf{self._calls}-{i}" for i in range(len(prompts))]
        index = {rid: i for i, rid in enumerate(ids)}
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        reasons: list[FinishReason | None] = [None] * len(prompts)
        added: dict[str, str] = {}  # our id -> vLLM's internal id
        try:
            for rid, p, sp in zip(ids, prompts, vparams, strict=True):
                added[rid] = engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), sp)
            pending = len(prompts)
            while pending:
                if self._gate.aborted(epoch):
                    break
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    c = out.outputs[0]
                    new = list(c.token_ids)
                    toks[i].extend(new)
                    lps[i].extend(sampled_logprobs(c.logprobs, new) if vparams[i].logprobs is not None
                                  else [0.0] * len(new))  # not asked for: "not computed"
                    if out.finished:
                        reasons[i] = finish_reason(c.finish_reason)
                        pending -= 1
                if pending and not engine.has_unfinished_requests():
                    raise EngineError(f"vLLM dropped {pending} requests without finishing them")
        finally:
            left = [rid for rid in added if reasons[index[rid]] is None]
            if left:
                states = engine.output_processor.request_states
                for rid in left:
                    i = index[rid]
                    state = states.get(added[rid])
                    # FINAL_ONLY: what an unfinished request generated is only in its output state.
                    if state is not None:
                        toks[i] = list(state.detokenizer.output_token_ids)
                        lps[i] = (sampled_logprobs(state.logprobs_processor.logprobs, toks[i])
                                  if vparams[i].logprobs is not None else [0.0] * len(toks[i]))
                engine.abort_request(left)
        return [Completion(t, lp, r or "abort") for t, lp, r in zip(toks, lps, reasons, strict=True)]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced `log_softmax(logits)` of tokens 1..n-1 of each sequence (vLLM prompt
        log-probs; these never read the prefix cache)."""
        from vllm.inputs import TokensPrompt

        check_prompts(sequences, self._vocab)
        vparams = [self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, flat_logprobs=True,
                                             detokenize=False, skip_special_tokens=False)
                   for _ in sequences]
        with self._gate.call(), self._engine_lock:
            outs = self._llm.generate([TokensPrompt(prompt_token_ids=list(s))
                                       for s in sequences], vparams, use_tqdm=False)
        return [sampled_logprobs(o.prompt_logprobs, list(s), skip_first=True)
                for s, o in zip(sequences, outs, strict=True)]

    # -- weights -------------------------------------------------------------------------------
    def _buckets(self, incoming: dict[str, torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Tensors on the engine's device and dtype, in buckets of about `sync_bucket_mb`. Each alias
        group's tensor goes under every name of the group: vLLM's loader takes the name it keeps
        (e.g. the embedding of a tied LM head) and skips the rest."""
        dtype = getattr(torch, self._dtype)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0  # bytes in `bucket`
        for group in self._groups:
            src = next(incoming[n] for n in group if n in incoming)
            t = src.detach().to(self._device, dtype=dtype, non_blocking=True)
            bucket += [(n, t) for n in group]
            size += t.numel() * t.element_size()
            if size >= self._bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                       reset_prefix_cache: bool = True) -> None:
        """Load the tensors into the running engine in place (strict, like the transformers backend),
        then reset the prefix cache. `reset_prefix_cache=False` exists to demonstrate stale KV."""
        incoming = unique_named(named_tensors)
        check_weights(incoming, self._expected, self._groups)
        self._load(self._buckets(incoming), version, reset_prefix_cache=reset_prefix_cache)

    def update_weights_stream(self, shapes: Mapping[str, tuple[int, ...]],
                              buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """`update_weights` one received bucket at a time (`engine.StreamingWeights`): the engine
        process of a broadcast sync holds one bucket beside the model, not a copy of it."""
        check_weights(shapes_only(shapes), self._expected, self._groups)
        dtype, groups_of, done = getattr(torch, self._dtype), {n: g for g in self._groups for n in g}, set[str]()

        def on_device() -> Iterator[list[tuple[str, torch.Tensor]]]:
            for bucket in buckets:
                out = [(a, t.to(self._device, dtype=dtype, non_blocking=True))
                       for a, t in alias_expand(bucket, groups_of, done)]
                if out:
                    yield out

        self._load(on_device(), version, complete=lambda: stream_complete(done, self._groups, version))

    def _load(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, *,
              reset_prefix_cache: bool = True, complete: Callable[[], None] | None = None) -> None:
        """Every bucket into vLLM's model under the gate, then the prefix cache, then the version. A
        failure after the first bucket leaves two versions in the model: `WeightsTorn`."""
        with self._gate.exclusive(lambda: check_version(version, self._version)):
            with self._engine_lock:
                t0, n, nb = time.perf_counter(), 0, 0
                try:
                    for bucket in buckets:
                        n += self._llm.collective_rpc(load_bucket, args=(bucket,))[0]
                        nb += 1
                    if complete is not None:
                        complete()
                except Exception as err:
                    if nb:
                        raise WeightsTorn(f"weight sync to version {version} failed after {nb} buckets:"
                                          f" {type(err).__name__}: {str(err)[:300]}") from err
                    raise
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                if reset_prefix_cache and not self._llm.reset_prefix_cache():
                    raise EngineError("vLLM refused to reset its prefix cache after a weight update")
                t2 = time.perf_counter()
            self._version = version
            self.last_sync = {"load_s": t1 - t0, "reset_s": t2 - t1, "total_s": t2 - t0, "buckets": nb,
                              "tensors": n}
            log.info("vLLM engine weights updated to version %d (%d tensors, %d buckets, %.3fs)", version, n,
                     nb, t2 - t0)

    def weight_checksums(self) -> list[Held]:
        """What vLLM's model holds after a sync, as made of the trainer's tensors (`weights.check`)."""
        rows, packed = self._llm.collective_rpc(held_checksums)[0]
        return held_in_trainer_names(rows, packed, self._groups)

    def reset_prefix_cache(self) -> bool:
        with self._engine_lock:
            return bool(self._llm.reset_prefix_cache())

    def close(self) -> None:
        """Shut vLLM down and free its GPU memory (so another engine can start in this process)."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # best effort: the memory is released below either way
            log.debug("vLLM shutdown: %s", e)
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception as e:
            log.debug("vLLM cleanup: %s", e)
        torch.cuda.empty_cache()

