"""A weight sync loaded bucket by bucket (`update_weights_stream`, what a broadcast sync feeds the
engine): the same weights as one `update_weights`, the whole plan checked before the first bucket,
tied tensors loaded once, and a stream that breaks or ends early after changing weights is torn,
never a silent mix of versions at the old version number."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.models.engine import SamplingParams, StreamingWeights, WeightsTorn, WeightSyncError
from services.models.engines.factory import make_engine
from services.models.weights.sync import alias_expand
from services.models.weights.transfer import plan
from tests.fleet_helpers import perturbed_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 5, 7, 9], [2, 3, 3, 8, 4]]


def _stream(weights: dict[str, torch.Tensor], bucket_bytes: int = 32 * 2**10):
    buckets, tensors = plan(weights.items(), None, bucket_bytes)
    shapes = {n: s for b in buckets for n, s in zip(b.names, b.shapes, strict=True)}
    parts = [list(zip(b.names, ts, strict=True)) for b, ts in zip(buckets, tensors, strict=True)]
    return shapes, parts


def _out(engine) -> list[list[float]]:  # type: ignore[no-untyped-def]
    done = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5, seed=1))
    return [c.logprobs for c in done]


def test_a_streamed_sync_loads_exactly_what_one_update_loads(random_model: Path) -> None:
    w = perturbed_state(random_model, 1)
    whole, streamed = make_engine("transformers", random_model), make_engine("transformers", random_model)
    assert isinstance(streamed, StreamingWeights)
    whole.update_weights(w.items(), 1)
    shapes, parts = _stream(w)
    assert len(parts) > 2
    streamed.update_weights_stream(shapes, iter(parts), 1)
    assert streamed.version == 1 and _out(streamed) == _out(whole)


def test_a_streamed_sync_is_checked_whole_before_its_first_bucket(random_model: Path) -> None:
    engine = make_engine("transformers", random_model)
    before = _out(engine)
    taken: list[int] = []

    def counted(parts: list) -> Iterator:  # type: ignore[type-arg]
        for i, p in enumerate(parts):
            taken.append(i)
            yield p

    w = perturbed_state(random_model, 2)
    shapes, parts = _stream(w)
    bad = dict(shapes, **{"not.a.weight": (3,)})
    with pytest.raises(WeightSyncError, match=r"unknown names: not\.a\.weight"):
        engine.update_weights_stream(bad, counted(parts), 1)
    wrong = {n: ((1,) if i == 0 else s) for i, (n, s) in enumerate(shapes.items())}
    with pytest.raises(WeightSyncError, match="shape mismatch"):
        engine.update_weights_stream(wrong, counted(parts), 1)
    engine.update_weights_stream(shapes, counted(parts), 3)
    with pytest.raises(WeightSyncError, match="older"):
        engine.update_weights_stream(shapes, counted(parts), 2)  # a version from the past
    assert taken == list(range(len(parts)))  # only the accepted sync took a bucket
    assert engine.version == 3 and _out(engine) != before


def test_a_stream_that_breaks_or_ends_early_after_a_bucket_is_torn(random_model: Path) -> None:
    engine = make_engine("transformers", random_model)
    shapes, parts = _stream(perturbed_state(random_model, 3))

    def breaking() -> Iterator:  # type: ignore[type-arg]
        yield parts[0]
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(WeightsTorn, match="failed midway: RuntimeError: Connection closed by peer"):
        engine.update_weights_stream(shapes, breaking(), 1)
    with pytest.raises(WeightsTorn, match="ended before"):
        engine.update_weights_stream(shapes, iter(parts[:-1]), 1)
    assert engine.version == 0  # a torn engine never claims the new version


def test_tied_tensors_go_under_every_alias_once_per_sync() -> None:
    groups = [["embed.weight", "lm_head.weight"], ["norm.weight"]]
    groups_of = {n: g for g in groups for n in g}
    t, u = torch.ones(2), torch.zeros(2)
    done: set[str] = set()
    first = list(alias_expand([("lm_head.weight", t)], groups_of, done))
    assert [n for n, _ in first] == ["embed.weight", "lm_head.weight"] and all(x is t for _, x in first)
    # The other name of the same group in a later bucket of the same sync is not loaded again.
    again = list(alias_expand([("embed.weight", u), ("norm.weight", u)], groups_of, done))
    assert [n for n, _ in again] == ["norm.weight"] and done == {"embed.weight", "norm.weight"}
