"""The generation-engine interface the actor and the local loop use (build one with
`services.models.engines.factory.make_engine`).

Contract every backend keeps (pinned by tests/unit/test_engine_contract.py):

- `generate(prompts, params)` returns one `Completion` per prompt, in order. A completion holds at
  most `max_new_tokens` tokens. Generation of a sequence stops at the first stop token (the
  tokenizer's EOS plus `params.stop_token_ids`); the stop token is part of the completion and its
  log-prob counts, since the policy chose to stop. `finish_reason` is "stop", "length" (hit
  `max_new_tokens` without a stop token) or "abort" (cut short by `abort()`).
- `logprobs[i]` is the log-prob of `token_ids[i]` under `log_softmax(logits / temperature)` over the
  full vocabulary, before top-k/top-p filtering (at temperature 0, greedy, under `log_softmax(logits)`).
  With `params.logprobs` False the engine computes none (vLLM's per-token log-prob output is a large
  share of its decode time) and `logprobs` is all zeros, meaning "not computed"; the tokens drawn are
  the same either way.
- Sampling is seeded per row: prompt i of a call draws from its own stream, seeded by
  (`params.seed`, `params.first_row + i`), so the same prompts, params and weights give the same
  completions in every process, however the prompts are batched or spread over engine replicas
  (`services.models.engines.replicas` gives each replica its slice with `first_row` set to where it starts).
  A call that joins several requests (the actor generating waiting messages together) names each
  row's seed instead (`params.row_seeds`, from `SamplingParams.seeds`): each row samples as it would
  have in its own request's call. `params.seed_of(i)` is row i's seed either way.
- `pause()` stops new `generate` calls from starting (they block until `resume()`) and returns once
  the calls already in flight have finished. `abort()` makes the calls in flight at that moment
  return early, keeping what they generated, with finish_reason "abort" on unfinished sequences;
  calls started afterwards are unaffected. For a fast weight sync: `abort(); pause();
  update_weights(...); resume()`.
- `update_weights(named_tensors, version)` waits for in-flight calls, then copies the tensors into the
  engine's model in place. It is strict: every parameter must be given (a tied alias counts for its
  twin), no unknown name, no shape mismatch, else `WeightSyncError` naming the offenders and nothing
  is changed. Versions never go backwards.
- `alive` is False once the engine can serve no more calls (its process died, or it was closed);
  `close()` releases what the engine holds (a child process, GPU memory) and may be called twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, Protocol, runtime_checkable

import torch

from services.rl.batch import Rollout

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """An engine that cannot be built or a call it cannot serve."""


class EngineUnavailable(EngineError):
    """The backend's package is not installed (or the backend is not implemented yet)."""


class WeightSyncError(EngineError):
    """`update_weights` got tensors that do not match the engine's model; nothing was changed."""


class WeightsTorn(EngineError):
    """A streamed weight sync failed after it had changed some weights: the engine holds a mix of
    two versions and must not serve again."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's EOS
    seed: int = 0
    # The index of this call's first prompt in the request it is a slice of: prompt i of the call is
    # seeded as row first_row + i, so a request spread over replicas samples as one call would.
    first_row: int = 0
    # Whether to compute each sampled token's log-prob; False leaves Completion.logprobs zeros (the
    # trainer then scores the tokens itself: generation.behaviour_logprobs "trainer").
    logprobs: bool = True
    # Each row's own seed, one per prompt of the call (empty: rows are seeded by seed and first_row).
    # Set by a call that joins requests of different seeds; `seed` and `first_row` are then unused.
    row_seeds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.first_row < 0:
            raise ValueError(f"first_row must be >= 0, got {self.first_row}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        bad = [s for s in self.row_seeds if not (isinstance(s, int) and 0 <= s < _SEED_MOD)]
        if bad:
            raise ValueError(f"row_seeds must be integers in [0, 2**63 - 1), got {bad[:3]}")

    def seed_of(self, row: int) -> int:
        """The sampling seed of row `row` of this call."""
        return self.row_seeds[row] if self.row_seeds else row_seed(self.seed, self.first_row + row)

    def seeds(self, n: int) -> tuple[int, ...]:
        """The seeds of this call's `n` rows, to carry them into a call that joins requests."""
        return tuple(self.seed_of(i) for i in range(n))

    def rows(self, start: int, stop: int) -> SamplingParams:
        """These params for rows [start, stop) of the call alone (a replica's slice): seeded as here."""
        if self.row_seeds:
            return replace(self, row_seeds=self.row_seeds[start:stop])
        return replace(self, first_row=self.first_row + start)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")


@runtime_checkable
class GenerationEngine(Protocol):
    @property
    def version(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def in_flight(self) -> int: ...  # generate calls running now (not those blocked by pause)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self) -> None: ...

    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class StreamingWeights(Protocol):
    """An engine that loads one sync bucket by bucket (`update_weights_stream`): it checks the
    version and every name and shape of the sync (`shapes`) before it takes the first bucket, so a
    broadcast sync (`services.models.weights.transfer`) never needs a second copy of the weights. A
    failure after the first bucket raises `WeightsTorn`."""

    def update_weights_stream(self, shapes: Mapping[str, tuple[int, ...]],
                              buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None: ...


_SEED_MOD = 2**63 - 1


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a request seeded with `seed` (distinct per row and per seed)."""
    return (int(seed) * 1_000_003 + int(row) * 7919 + 1) % _SEED_MOD


def check_prompts(prompts: list[list[int]], vocab_size: int, params: SamplingParams | None = None) -> None:
    """Every prompt non-empty and inside the vocabulary, and one row seed per prompt where `params`
    names them, else an `EngineError` naming the first bad one."""
    if params is not None and params.row_seeds and len(params.row_seeds) != len(prompts):
        raise EngineError(f"{len(params.row_seeds)} row seeds for {len(prompts)} prompts; give one per prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise EngineError(f"prompt {i} is empty; a prompt needs at least one token (e.g. BOS)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise EngineError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def completions_to_rollout(
    task_ids: list[str],
    prompts: list[list[int]],
    completions: list[Completion],
    group_ids: list[int],
    version: int,
    pad_id: int,
) -> Rollout:
    """Pack prompts (left-padded to the longest) and completions (right-padded) into a `Rollout`."""
    b = len(task_ids)
    if not len(prompts) == len(completions) == len(group_ids) == b:
        raise ValueError(f"lengths disagree: {b} task ids, {len(prompts)} prompts, {len(completions)}"
                         f" completions, {len(group_ids)} group ids")
    p = max((len(x) for x in prompts), default=0)
    r = max((len(c.token_ids) for c in completions), default=0)
    prompt_ids = torch.full((b, p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p), dtype=torch.bool)
    response_ids = torch.full((b, r), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, r), dtype=torch.bool)
    logprobs = torch.zeros((b, r), dtype=torch.float32)
    for i, (ids, c) in enumerate(zip(prompts, completions, strict=True)):
        if ids:
            prompt_ids[i, p - len(ids):] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[i, p - len(ids):] = True
        n = len(c.token_ids)
        if n:
            response_ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
            response_mask[i, :n] = True
            logprobs[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    return Rollout(
        task_ids=list(task_ids),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=logprobs,
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        version=version,
    )
