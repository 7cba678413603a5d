"""`TransformersEngine`: the transformers generation backend, with its own sampling loop.

Prompts are left-padded into one batch (or micro-batches), prefilled once, then decoded one token per
step through the model's KV cache, with position ids counted from each row's first real token so a
row generates the same tokens however much padding it got. See `services.models.engine` for the
contract (stop tokens, finish reasons, pause/abort, strict weight sync).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.models.engine import (
    Completion,
    EngineError,
    FinishReason,
    SamplingParams,
    WeightsTorn,
    check_prompts,
)
from services.models.engines.gate import CallGate
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import accepts_kwarg, position_ids_from_mask
from services.models.weights.check import Held, held_by_state
from services.models.weights.sync import (
    alias_expand,
    check_version,
    check_weights,
    shapes_only,
    stream_complete,
    unique_named,
)

log = logging.getLogger(__name__)


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5 calls the KV cache `cache`; older releases call it `past_key_values`."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from `[B, V]` logits; returns (tokens [B], their log-probs [B], zeros
    when `params.logprobs` is False).
    `generator` is one stream for every row, or one per row (what the engine uses: a row then draws
    the same tokens whatever else is in its batch).

    The log-prob is taken from `log_softmax(logits / temperature)` over the FULL vocabulary, before
    top-k/top-p filtering: the trainer recomputes log-probs with a plain softmax at the same
    temperature, so reporting the unfiltered value keeps behaviour and trainer log-probs identical for
    the same weights (the importance ratio is exactly 1 on-policy). Filtering only changes which
    tokens can be drawn, not how they are scored.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_logprobs(logits, tokens, params.logprobs)
    scaled = logits / params.temperature
    filtered = scaled
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    if isinstance(generator, torch.Generator):
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        tokens = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generator)])
    return tokens, _token_logprobs(scaled, tokens, params.logprobs)


def _token_logprobs(scores: torch.Tensor, tokens: torch.Tensor, wanted: bool) -> torch.Tensor:
    if not wanted:  # "not computed": the full-vocabulary log_softmax is skipped
        return torch.zeros(tokens.shape, dtype=scores.dtype, device=scores.device)
    return torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


class TransformersEngine:
    """A causal LM from transformers, sampled by our own KV-cache loop. Thread-safe: generate, pause,
    resume, abort and update_weights may be called from different threads."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        *,
        micro_batch: int = 0,
        version: int = 0,
    ):
        if not eos_token_ids:
            raise EngineError("the engine needs at least one EOS token id")
        if micro_batch < 0:
            raise EngineError(f"micro_batch must be >= 0 (0 = whole batch), got {micro_batch}")
        self._model = model.eval()
        self._eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self._pad = int(pad_token_id)
        self._micro_batch = micro_batch
        self._version = version
        self._cache_kw = _cache_kwarg(model)
        self._keep_last: dict[str, Any] = {"logits_to_keep": 1} if accepts_kwarg(model, "logits_to_keep") else {}
        emb = model.get_input_embeddings()  # type: ignore[operator]
        self._vocab = int(emb.num_embeddings)
        self._device = emb.weight.device
        self._gate = CallGate()

    @classmethod
    def from_path(
        cls, path: Path, *, dtype: str = "float32", device: str = "cpu", micro_batch: int = 0
    ) -> TransformersEngine:
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype=dtype, device=device)
        eos: list[int] = []
        if tokenizer.eos_token_id is not None:
            eos.append(int(tokenizer.eos_token_id))
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            eos.extend([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
        if not eos:
            raise EngineError(f"model at {path} has no EOS token (tokenizer nor generation_config)")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        log.info("transformers engine: %s on %s (%s), eos=%s", path, device, dtype, eos)
        return cls(model, eos, int(pad), micro_batch=micro_batch)

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
        return True  # the engine lives in the caller's process

    @property
    def model(self) -> nn.Module:
        return self._model

    def pause(self) -> None:
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def abort(self) -> None:
        self._gate.abort()

    def close(self) -> None:
        """Nothing to release: the model goes with the engine object."""

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        check_prompts(prompts, self._vocab, params)
        with self._gate.call() as epoch:
            generators = [torch.Generator(device=self._device).manual_seed(params.seed_of(i))
                          for i in range(len(prompts))]
            stop = torch.tensor(sorted(set(self._eos) | set(params.stop_token_ids)), device=self._device)
            step = self._micro_batch or max(len(prompts), 1)
            out: list[Completion] = []
            for start in range(0, len(prompts), step):
                chunk = prompts[start:start + step]
                if self._gate.aborted(epoch):
                    out.extend(Completion([], [], "abort") for _ in chunk)
                else:
                    out.extend(self._generate_chunk(chunk, params, stop, generators[start:start + step], epoch))
            return out

    @torch.no_grad()
    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop: torch.Tensor,
        generators: list[torch.Generator],
        epoch: int,
    ) -> list[Completion]:
        b, p, n = len(prompts), max(len(x) for x in prompts), params.max_new_tokens
        dev = self._device
        ids = torch.full((b, p), self._pad, dtype=torch.long, device=dev)
        mask = torch.zeros((b, p + n), dtype=torch.long, device=dev)
        for i, x in enumerate(prompts):
            ids[i, p - len(x):] = torch.tensor(x, dtype=torch.long, device=dev)
            mask[i, p - len(x):p] = 1
        mask[:, p:] = 1  # generated columns; a finished row's tail is never read back
        positions = position_ids_from_mask(mask[:, :p])
        next_pos = positions[:, -1] + 1

        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        tokens: list[torch.Tensor] = []
        logps: list[torch.Tensor] = []
        aborted = False
        cache: Any = None
        step_ids, step_pos = ids, positions
        for t in range(n):
            if self._gate.aborted(epoch):
                aborted = True
                break
            kwargs: dict[str, Any] = {self._cache_kw: cache}
            out = self._model(
                input_ids=step_ids,
                attention_mask=mask[:, : p + t],
                position_ids=step_pos,
                use_cache=True,
                **self._keep_last,
                **kwargs,
            )
            cache = _output_cache(out)
            tok, lp = sample_next(out.logits[:, -1, :], params, generators)
            alive = ~finished
            tok = torch.where(alive, tok, torch.full_like(tok, self._pad))
            tokens.append(tok)
            logps.append(torch.where(alive, lp, torch.zeros_like(lp)))
            lengths += alive.long()
            hit = alive & torch.isin(tok, stop)
            stopped |= hit
            finished |= hit
            if bool(finished.all()):
                break
            step_ids, step_pos = tok[:, None], next_pos[:, None]
            next_pos = next_pos + 1

        tok_rows = torch.stack(tokens, dim=1).tolist() if tokens else [[] for _ in range(b)]
        lp_rows = torch.stack(logps, dim=1).tolist() if logps else [[] for _ in range(b)]
        result: list[Completion] = []
        for i in range(b):
            k = int(lengths[i])
            reason: FinishReason
            if bool(stopped[i]):
                reason = "stop"
            elif aborted:
                reason = "abort"
            else:
                reason = "length"
            result.append(Completion(tok_rows[i][:k], lp_rows[i][:k], reason))
        return result

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        incoming = unique_named(named_tensors)
        with self._gate.exclusive(lambda: check_version(version, self._version)):
            load_strict(self._model, incoming)
            self._version = version
            log.info("engine weights updated to version %d (%d tensors)", version, len(incoming))

    def update_weights_stream(self, shapes: Mapping[str, tuple[int, ...]],
                              buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """`update_weights` one bucket at a time (`engine.StreamingWeights`)."""
        with self._gate.exclusive(lambda: check_version(version, self._version)):
            state, groups = _targets(self._model)
            check_weights(shapes_only(shapes), {n: tuple(t.shape) for n, t in state.items()}, groups)
            groups_of = {n: g for g in groups for n in g}
            done: set[str] = set()
            try:
                with torch.no_grad():
                    for bucket in buckets:
                        for n, t in alias_expand(bucket, groups_of, done):
                            state[n].copy_(t)
            except Exception as err:
                if done:
                    raise WeightsTorn(f"weight sync to version {version} failed midway:"
                                      f" {type(err).__name__}: {str(err)[:300]}") from err
                raise
            stream_complete(done, groups, version)
            self._version = version
            log.info("engine weights updated to version %d (%d tensors, streamed)", version, len(shapes))


    def weight_checksums(self) -> list[Held]:
        """What the model holds, for the checksum check of a sync (`weights.check`): its parameters
        carry the trainer's names, so each alias group is one entry."""
        state, groups = _targets(self._model)
        return held_by_state(state, groups)


def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """The model's parameters and persistent buffers by name, and its alias groups: tied tensors
    (e.g. lm_head.weight and embed_tokens.weight) share storage, and either name is enough."""
    state = model.state_dict(keep_vars=True)
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for n, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        groups.setdefault(key, []).append(n)
    return state, list(groups.values())


def load_strict(model: nn.Module, incoming: dict[str, torch.Tensor]) -> None:
    """Copy `incoming` into the model's parameters and persistent buffers in place, all or nothing.
    Raises `WeightSyncError` naming unknown, missing and mis-shaped tensors."""
    state, groups = _targets(model)
    check_weights(incoming, {n: tuple(t.shape) for n, t in state.items()}, groups)
    with torch.no_grad():
        for n, t in incoming.items():
            state[n].copy_(t)
