"""The actor's engine batching (services/actor/batching.py) over a real transformers engine: prompt
messages that wait together go into one engine call and come out as each would have alone; a bad one
fails alone; requests that cannot share a call do not."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.actor.batching import EngineBatcher, Generated
from services.core.config.run import TinyModelSpec
from services.models.engine import EngineError, GenerationEngine, SamplingParams
from services.models.engines.factory import make_engine
from services.models.io.loading import load_tokenizer
from services.models.roles.tiny import build_tiny_model
from services.models.roles.tokenizer import encode_prompt
from services.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(make_task("sentiment"), TinyModelSpec(warmup_steps=0), tmp_path_factory.mktemp("m"), seed=0)


@pytest.fixture(scope="module")
def engine(model: Path) -> GenerationEngine:
    return make_engine("transformers", model)


@pytest.fixture(scope="module")
def messages(model: Path) -> list[list[list[int]]]:
    """Four messages of three prompts each, of different lengths (real left padding when joined)."""
    task, tok = make_task("sentiment"), load_tokenizer(model)
    prompts = [encode_prompt(tok, task.prompt(i).text) for i in range(12)]
    return [[p[: 1 + (i + j) % len(p)] for j, p in enumerate(prompts[i:i + 3])] for i in range(0, 12, 3)]


def _batcher(engine: GenerationEngine, max_requests: int = 8,
             version: int = 3) -> tuple[EngineBatcher, CollectorRegistry]:
    registry = CollectorRegistry()
    return EngineBatcher(engine.generate, asyncio.Lock(), lambda: version, max_requests, registry=registry), registry


def _calls(registry: CollectorRegistry) -> tuple[float, float]:
    """(engine calls, messages) observed by the batcher's histogram."""
    return (registry.get_sample_value("rlfleet_engine_call_messages_count") or 0.0,
            registry.get_sample_value("rlfleet_engine_call_messages_sum") or 0.0)


def test_messages_waiting_together_go_in_one_engine_call_and_come_out_as_each_alone(
    engine: GenerationEngine, messages: list[list[list[int]]],
) -> None:
    seeded = [replace(PARAMS, seed=10 + i) for i in range(len(messages))]
    alone = [engine.generate(m, p) for m, p in zip(messages, seeded, strict=True)]

    async def main() -> tuple[list[Generated], tuple[float, float]]:
        batcher, registry = _batcher(engine)
        got = await asyncio.gather(*(batcher.generate(m, p) for m, p in zip(messages, seeded, strict=True)))
        return list(got), _calls(registry)

    got, calls = asyncio.run(main())
    assert calls == (1.0, 4.0)
    assert [g.requests for g in got] == [4, 4, 4, 4] and {g.version for g in got} == {3}
    assert [[c.token_ids for c in g.completions] for g in got] == [[c.token_ids for c in a] for a in alone]
    for g, a in zip(got, alone, strict=True):
        for x, y in zip(g.completions, a, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_requests_pile_up_behind_the_engine_lock_and_go_out_in_calls_of_at_most_the_bound(
    engine: GenerationEngine, messages: list[list[list[int]]],
) -> None:
    async def main() -> tuple[list[int], tuple[float, float]]:
        registry = CollectorRegistry()
        lock = asyncio.Lock()
        batcher = EngineBatcher(engine.generate, lock, lambda: 0, 3, registry=registry)
        async with lock:  # a weight sync holds the engine while five messages arrive
            pending = [asyncio.create_task(batcher.generate(messages[i % 4], replace(PARAMS, seed=i)))
                       for i in range(5)]
            await asyncio.sleep(0.05)
        got = await asyncio.gather(*pending)
        return [g.requests for g in got], _calls(registry)

    requests, calls = asyncio.run(main())
    assert requests == [3, 3, 3, 2, 2] and calls == (2.0, 5.0)


def test_a_bad_message_fails_alone_and_the_messages_generated_with_it_are_kept(
    engine: GenerationEngine, messages: list[list[list[int]]],
) -> None:
    bad = [[10**6]]  # outside the vocabulary: the joined call fails on it

    async def main() -> list[Generated | BaseException]:
        batcher, _ = _batcher(engine)
        return list(await asyncio.gather(batcher.generate(messages[0], PARAMS), batcher.generate(bad, PARAMS),
                                         batcher.generate(messages[1], replace(PARAMS, seed=1)),
                                         return_exceptions=True))

    first, err, third = asyncio.run(main())
    assert isinstance(err, EngineError) and "outside the vocabulary" in str(err)
    assert isinstance(first, Generated) and isinstance(third, Generated)
    assert first.requests == third.requests == 1  # made again one at a time
    assert [c.token_ids for c in first.completions] == [c.token_ids for c in engine.generate(messages[0], PARAMS)]


def test_messages_sampled_differently_are_not_joined(
    engine: GenerationEngine, messages: list[list[list[int]]],
) -> None:
    async def main() -> tuple[list[int], tuple[float, float]]:
        batcher, registry = _batcher(engine)
        got = await asyncio.gather(batcher.generate(messages[0], PARAMS),
                                   batcher.generate(messages[1], replace(PARAMS, temperature=0.5)),
                                   batcher.generate(messages[2], replace(PARAMS, seed=2)))
        return [g.requests for g in got], _calls(registry)

    requests, calls = asyncio.run(main())
    assert requests == [2, 1, 2] and calls == (2.0, 3.0)


def test_a_batcher_needs_at_least_one_request_per_call(engine: GenerationEngine) -> None:
    with pytest.raises(ValueError, match="max_requests must be >= 1, got 0"):
        EngineBatcher(engine.generate, asyncio.Lock(), lambda: 0, 0)
