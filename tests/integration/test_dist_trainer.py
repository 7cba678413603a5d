"""A 2-rank trainer (real follower process, gloo, FSDP2 on the CPU) takes the same optimizer step
as one rank, for the actor's policy and the critic's value model, and resumes a 1-rank
checkpoint (weights and optimizer state) to take the same next step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from services.core.config.run import RunConfig, ServiceName
from services.dist.build import Trainer, build_model, build_trainer
from services.dist.group import RankGroup
from services.dist.protocol import Op
from services.models.checkpoints.checkpoint import load_latest, save_checkpoint
from services.models.nets.critic import ValueModel
from services.rl.batch import Rollout
from services.rl.trainer import PolicyTrainer
from tests.fleet_helpers import tiny_config

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = pytest.mark.shares_host


def _cfg(tmp: Path, model: Path, ranks: int) -> RunConfig:
    # Several minibatches (the second sees the first's update), micro-batches of 3 rows (ranks get
    # unequal piece counts: the padding path) and a KL term: the paths a wrong share would break.
    return tiny_config(tmp, model, services={"actor": {"trainer_ranks": ranks}, "critic": {"trainer_ranks": ranks}},
                       algo={"minibatch_size": 7, "micro_batch_size": 3, "ppo_epochs": 2, "lr": 1e-3})


def _rollout(vocab: int, b: int = 13, p: int = 4, r: int = 4) -> Rollout:
    g = torch.Generator().manual_seed(3)
    resp_mask = torch.ones(b, r, dtype=torch.bool)
    for i in range(b):  # ragged responses, some empty
        resp_mask[i, (i * 3) % (r + 1):] = False
    prompt_mask = torch.ones(b, p, dtype=torch.bool)
    prompt_mask[0, :2] = False
    return Rollout(
        task_ids=[f"t{i}" for i in range(b)],
        prompt_ids=torch.randint(1, vocab, (b, p), generator=g), prompt_mask=prompt_mask,
        response_ids=torch.randint(1, vocab, (b, r), generator=g), response_mask=resp_mask,
        behaviour_logprobs=-torch.rand(b, r, generator=g) * 3, group_ids=torch.arange(b) // 4,
        advantages=torch.randn(b, r, generator=g), returns=torch.randn(b, r, generator=g),
        values=torch.randn(b, r, generator=g), ref_logprobs=-torch.rand(b, r, generator=g) * 3,
    )


def _one_rank(cfg: RunConfig, service: ServiceName, r: Rollout) -> tuple[Trainer, dict[str, float]]:
    model = build_model(cfg, service, "cpu")
    tr = build_trainer(cfg, service, model)
    stats = tr.train_step(r, 1, 0) if service == "actor" else tr.train_step(r, 1)  # type: ignore[call-arg]
    return tr, stats


def _assert_same_params(one: nn.Module, full: dict[str, torch.Tensor]) -> None:
    sd = one.state_dict()
    assert set(full) <= set(sd) and len(full) > 0
    # A key bias gets no gradient in exact arithmetic (softmax ignores a shift shared by all keys),
    # so its gradient is float noise, which Adam's first steps turn into updates of up to lr each
    # (4 optimizer steps here): it can only be held to that bound. Every other tensor is held to 1%
    # of one step's lr: two ranks sum the gradient in another order, and Adam divides each element by
    # its own gradient's size, so an element whose gradient is near zero turns that float32 rounding
    # into an update difference well above rounding (7.4e-6 seen once in q_proj); a lost or doubled
    # shard, or a mis-weighted micro-batch, moves whole tensors by about lr.
    off = {name: float((t - sd[name]).abs().max()) for name, t in full.items()
           if not torch.allclose(t, sd[name], atol=4e-3 if name.endswith("k_proj.bias") else 1e-5, rtol=1e-4)}
    assert not off, off


def _two_ranks(tmp_path: Path, tiny_model: Path, service: ServiceName) -> None:
    r = _rollout(int(build_model(_cfg(tmp_path, tiny_model, 1), "actor", "cpu").config.vocab_size))  # type: ignore[union-attr]
    tr, stats1 = _one_rank(_cfg(tmp_path, tiny_model, 1), service, r)
    one = tr.model
    before = build_model(_cfg(tmp_path, tiny_model, 1), service, "cpu").state_dict()
    group = RankGroup(_cfg(tmp_path, tiny_model, 2), service)
    try:
        stats2 = group.train(r, 1, 0)
        full = group.call(Op.FULL_STATE)
        status = group.status()
        _assert_same_params(one, full)  # before the resume below trains `one` further
        if service == "actor":
            _resume_on_two_ranks(tmp_path / "ckpt", tr, group, r)
        else:  # the critic scores through its sharded model: the values the one rank gives
            assert isinstance(one, ValueModel)
            with torch.no_grad():
                want = one.values(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
            assert torch.allclose(group.call(Op.SCORE, r), want, atol=1e-5)
    finally:
        group.close()
    # The step moved the weights, and both runs moved them alike.
    assert any(not torch.equal(before[k], full[k]) for k in full)
    assert stats1.keys() == stats2.keys()
    for k, v in stats1.items():
        assert abs(v - stats2[k]) <= 1e-4 * max(1.0, abs(v)), (k, v, stats2[k])
    assert [s["rank"] for s in status] == [0, 1] and all(s["alive"] for s in status)
    assert all(s["step_seconds"] > 0 and s["memory_bytes"] > 0 for s in status)


def _resume_on_two_ranks(root: Path, tr: Trainer, group: RankGroup, r: Rollout) -> None:
    """A 1-rank checkpoint (safetensors, optimizer state by index) loads into the 2 ranks: the same
    weights, and the same next step, so the optimizer's moments came along too."""
    assert isinstance(tr, PolicyTrainer)
    tr.train_step(r, 2, 1)  # one rank moves on, so loading it is visible
    save_checkpoint(root, "actor", 2, 2, tr.model, tr.opt)
    meta = load_latest(root, "actor", group.trainer.model, group.trainer.opt, rank_load=group.load)
    assert meta is not None and meta.layout == "safetensors"
    _assert_same_params(tr.model, group.call(Op.FULL_STATE))
    tr.train_step(r, 3, 2)
    group.train(r, 3, 2)
    _assert_same_params(tr.model, group.call(Op.FULL_STATE))


def test_two_rank_actor_takes_the_one_rank_step(tmp_path: Path, tiny_model: Path) -> None:
    _two_ranks(tmp_path, tiny_model, "actor")


def test_two_rank_critic_takes_the_one_rank_step(tmp_path: Path, tiny_model: Path) -> None:
    _two_ranks(tmp_path, tiny_model, "critic")
