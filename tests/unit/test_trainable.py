"""Trainable's weights from a path: all or nothing, optimizer state with an rlfleet checkpoint and
reset without one, and the version gate (never backwards, never past the committed version)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from services.core.config.run import parse_config
from services.models.checkpoints.checkpoint import save_checkpoint
from services.workers.trainable import Trainable, WeightsRefused


def trainable(tmp_path: Path, seed: int = 0) -> Trainable:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # some optimizer state, as a trained actor has
    cfg = parse_config({"run": {"dir": str(tmp_path / "run")}})
    return Trainable(cfg, "actor", model, opt)


def params(t: Trainable) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


def test_a_checkpoint_brings_its_weights_and_optimizer_state(tmp_path: Path) -> None:
    src = trainable(tmp_path, seed=1)
    ckpt = save_checkpoint(tmp_path / "ckpt", "actor", 5, 4, src.model, src.optimizer)
    dst = trainable(tmp_path, seed=2)
    assert dst.load_weights(ckpt, 5) == 4
    for a, b in zip(params(dst), params(src), strict=True):
        torch.testing.assert_close(a, b)
    exp_avg = [dst.optimizer.state[p]["exp_avg"] for p in dst.model.parameters()]
    for a, p in zip(exp_avg, src.model.parameters(), strict=True):
        torch.testing.assert_close(a, src.optimizer.state[p]["exp_avg"])
    with pytest.raises(WeightsRefused, match="version 5, not 6"):
        dst.load_weights(ckpt, 6)


def test_safetensors_weights_reset_the_optimizer_and_a_mismatch_changes_nothing(tmp_path: Path) -> None:
    src = trainable(tmp_path, seed=1)
    good = tmp_path / "good"
    good.mkdir()
    save_file({k: v.contiguous() for k, v in src.model.state_dict().items()}, str(good / "model.safetensors"))
    dst = trainable(tmp_path, seed=2)
    assert dst.load_weights(good, 3) == 2
    assert not dst.optimizer.state  # moments of other weights would steer the next step wrong
    torch.testing.assert_close(params(dst)[0], params(src)[0])

    bad = tmp_path / "bad"
    bad.mkdir()
    wrong = dict(src.model.state_dict())
    wrong["1.weight"] = torch.zeros(5, 3)  # the first tensor fits, the last does not
    save_file({k: v.contiguous() for k, v in wrong.items()}, str(bad / "model.safetensors"))
    fresh = trainable(tmp_path, seed=3)
    before = params(fresh)
    with pytest.raises(WeightsRefused, match="shape mismatch") as err:
        fresh.load_weights(bad, 4)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for a, b in zip(params(fresh), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(WeightsRefused, match="neither"):
        fresh.load_weights(tmp_path, 4)


def test_weights_never_go_backwards_nor_past_the_committed_version(tmp_path: Path) -> None:
    t = trainable(tmp_path)
    t.version = 4
    t.check_weights_version(4, committed=4)
    t.check_weights_version(6, committed=6)
    for version, committed, word in ((3, 9, "backwards"), (7, 6, "ahead")):
        with pytest.raises(WeightsRefused, match=word) as err:
            t.check_weights_version(version, committed)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_replayed_train_of_the_last_step_returns_that_steps_figures(tmp_path: Path) -> None:
    """A controller that crashed between Train and its commit sends the step again: nothing is
    applied twice, and the answer still carries the step's loss for the step's metrics row."""
    import asyncio

    from services.rl.wire import train_batch_to_proto
    from tests.unit.test_rl_algorithms import rollout

    t = trainable(tmp_path)
    applied: list[int] = []

    async def apply(req: Any) -> dict[str, float]:
        applied.append(req.target_version)
        return {"policy_loss": 0.25 * req.target_version}

    def train(step: int) -> Any:
        batch = train_batch_to_proto(rollout([1.0, 0.0], [3, 2]), step=step, batch_id=f"s{step}",
                                     target_version=step + 1)
        return asyncio.run(t.train(batch, None, require=(), apply=apply))

    assert dict(train(0).stats) == {"policy_loss": 0.25}
    assert dict(train(1).stats) == {"policy_loss": 0.5}
    again = train(1)
    assert again.replayed and dict(again.stats) == {"policy_loss": 0.5} and applied == [1, 2]
    older = train(0)  # an older step's figures are gone: its replay answers without them
    assert older.replayed and dict(older.stats) == {} and applied == [1, 2]
