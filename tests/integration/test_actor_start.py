"""The actor builds its trainer while its engine process starts, where nothing profiles the GPU's free
memory (`GenerationSection.starts_beside_trainer`): a real transformers engine in a real child
process. A trainer that fails meanwhile fails the actor at once, and the engine it started is closed
as soon as it is up instead of outliving the failure."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from services.actor.server import Actor
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.timeout(180)


def test_a_trainer_that_fails_beside_a_starting_engine_fails_the_actor_and_closes_the_engine(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_model, generation={"process": True})
    assert cfg.generation.starts_beside_trainer({})

    failed_at: list[float] = []

    def broken(self: Actor, cfg: object) -> None:
        deadline = time.monotonic() + 30
        while not multiprocessing.active_children():  # the engine's process starts meanwhile
            assert time.monotonic() < deadline, "no engine process started beside the trainer"
            time.sleep(0.05)
        failed_at.append(time.monotonic())
        raise MemoryError("no room for the trainer")

    monkeypatch.setattr(Actor, "_build_trainer", broken)
    with pytest.raises(MemoryError, match="no room for the trainer"):
        Actor(cfg)
    assert time.monotonic() - failed_at[0] < 2  # the failure is not held until the engine is up
    deadline = time.monotonic() + 120
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children(), "the engine process outlived the failed actor start"
