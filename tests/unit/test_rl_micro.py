"""Token-budget micro-batch plans: every row once, rows x width within the budget, weights that sum to
the minibatch's loss, and the config's one-line errors."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError

from services.core.config.run import AlgoSection
from services.rl import micro
from services.rl.batch import Rollout
from services.rl.micro import part_of, plan, real_lengths


def _rollout(plen: list[int], rlen: list[int]) -> Rollout:
    b, p, r = len(plen), max(plen), max(rlen)
    pm = torch.arange(p)[None, :] >= p - torch.tensor(plen)[:, None]
    rm = torch.arange(r)[None, :] < torch.tensor(rlen)[:, None]
    return Rollout(task_ids=[str(i) for i in range(b)], prompt_ids=torch.ones(b, p, dtype=torch.long), prompt_mask=pm,
                   response_ids=torch.ones(b, r, dtype=torch.long), response_mask=rm,
                   behaviour_logprobs=torch.zeros(b, r), group_ids=torch.arange(b))


def _lognormal(n: int, seed: int) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    plen = (torch.randn(n, generator=g) * 0.4 + 3.0).exp().long().clamp(1, 80)
    rlen = (torch.randn(n, generator=g) * 0.8 + 3.5).exp().long().clamp(0, 200)
    return _rollout(plen.tolist(), rlen.tolist())


@pytest.mark.parametrize("pack", [False, True])
def test_a_token_budget_covers_every_row_once_within_the_budget(pack: bool) -> None:
    r = _lognormal(64, seed=1)
    budget = 1024
    plans = plan(r, "token_mean", tokens=budget, pack=pack)
    rows = torch.cat([m.rows for m in plans]).sort().values
    assert rows.tolist() == list(range(len(r)))
    assert sum(m.weight for m in plans) == pytest.approx(1.0)
    tokens = r.response_mask.sum(1)
    width = int(sum(real_lengths(r)).max())
    for m in plans:
        part = part_of(r, m)
        assert m.weight == pytest.approx(float(tokens[m.rows].sum() / tokens.sum()))
        assert m.bins is not None and sorted(j for b in m.bins for j in b) == list(range(len(part)))
        lengths = sum(real_lengths(part))
        # cut to its own response width, so per-token tensors carry no column no row needs
        assert part.response_ids.shape[1] == max(int(real_lengths(part)[1].max()), 1)
        if pack:  # rows as wide as the minibatch's longest sequence
            assert all(int(lengths[b].sum()) <= width for b in m.bins)
            assert len(m.bins) * width <= budget
        else:  # one sequence per row, rows as wide as the micro-batch's longest
            assert all(len(b) == 1 for b in m.bins)
            assert len(part) * int(lengths.max()) <= budget
    assert len(plans) > 2


def _computed(r: Rollout, plans: list[micro.MicroBatch]) -> int:
    """Token slots the forwards of a plan compute: rows x the widest row, per micro-batch."""
    out = 0
    for m in plans:
        lengths = sum(real_lengths(part_of(r, m)))
        assert m.bins is not None
        out += len(m.bins) * max(int(lengths[b].sum()) for b in m.bins)
    return out


def test_budget_plans_pad_far_less_than_the_rollout_width(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _lognormal(256, seed=2)
    real = int(r.prompt_mask.sum() + r.response_mask.sum())
    full = len(r) * (r.prompt_ids.shape[1] + r.response_ids.shape[1])
    plans = plan(r, "token_mean", tokens=2048)
    cut = _computed(r, plans)
    packed = _computed(r, plan(r, "token_mean", tokens=2048, pack=True))
    assert 1 - real / full > 0.6  # the lengths are mixed: most of the rollout layout is padding
    assert 1 - real / cut < 0.10 and 1 - real / packed < 0.05, (real, cut, packed, full)
    monkeypatch.setattr(micro, "_EXACT_MAX_ROWS", 0)  # plain filling: as many micro-batches, more padding
    filled = plan(r, "token_mean", tokens=2048)
    assert len(filled) == len(plans) and _computed(r, filled) > cut


def test_a_sequence_over_the_budget_gets_its_own_micro_batch_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(micro, "_said_oversize", False)
    r = _rollout([2, 30, 2, 25], [2, 10, 1, 20])
    with caplog.at_level(logging.WARNING, logger="rlfleet.rl.micro"):
        plans = plan(r, "seq_mean_token_mean", tokens=16)
        plan(r, "token_mean", tokens=16)
    assert [m.rows.tolist() for m in plans] == [[3], [1], [0, 2]]
    assert [m.weight for m in plans] == pytest.approx([0.25, 0.25, 0.5])
    said = [rec for rec in caplog.records if "longer than the micro-batch token budget" in rec.getMessage()]
    assert len(said) == 1


def test_micro_batch_tokens_excludes_micro_batch_size_and_packing_needs_it() -> None:
    assert AlgoSection(micro_batch_tokens=4096, pack_sequences=True).pack_sequences
    with pytest.raises(ValidationError, match="micro_batch_size and micro_batch_tokens exclude each other"):
        AlgoSection(micro_batch_size=8, micro_batch_tokens=4096)
    with pytest.raises(ValidationError, match="pack_sequences needs micro_batch_tokens > 0"):
        AlgoSection(pack_sequences=True)
