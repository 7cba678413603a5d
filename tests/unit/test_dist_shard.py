"""Each rank's share of a minibatch: every row trained exactly once over the ranks, the weights
summing to the one-rank total (times the rank count FSDP2 averages over), equal piece counts."""

from __future__ import annotations

import pytest
import torch

from services.core.config.run import AlgoSection, ConfigError, parse_config
from services.dist.shard import rank_split
from services.rl.batch import Rollout
from services.rl.trainer import micro_plan


def _mb(n: int, r: int = 4) -> Rollout:
    mask = torch.ones(n, r, dtype=torch.bool)
    for i in range(n):
        mask[i, (i * 3) % (r + 1):] = False  # ragged, some rows empty
    z = torch.zeros(n, r)
    return Rollout(task_ids=[str(i) for i in range(n)], prompt_ids=torch.ones(n, 2, dtype=torch.long),
                   prompt_mask=torch.ones(n, 2, dtype=torch.bool), response_ids=torch.ones(n, r, dtype=torch.long),
                   response_mask=mask, behaviour_logprobs=z, group_ids=torch.arange(n))


@pytest.mark.parametrize("n,micro,world", [(13, 3, 2), (7, 0, 2), (1, 0, 2), (5, 2, 4), (16, 4, 3), (13, -12, 2)])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_ranks_cover_every_row_once_with_the_one_rank_weights(n: int, micro: int, world: int, agg: str) -> None:
    mb = _mb(n)
    # micro < 0: a token budget of -micro tokens per micro-batch instead of a row count.
    algo = AlgoSection(loss_agg=agg, micro_batch_size=max(micro, 0), micro_batch_tokens=max(-micro, 0))
    shares = [[(p.rows, p.weight) for p in rank_split(r, world)(mb, algo)] for r in range(world)]
    assert len({len(s) for s in shares}) == 1, "every rank runs as many forwards and backwards"
    m = mb.response_mask.bool()
    units = m.sum(1) if agg == "token_mean" else m.any(1).long()
    total = int(units.sum())
    real = [(rows, w) for s in shares for rows, w in s if w > 0]
    # Rows that carry loss (all rows when none does) are trained by exactly one rank.
    counted = sorted(int(i) for rows, _ in real for i in rows if units[i] > 0 or total == 0)
    assert counted == [i for i in range(n) if units[i] > 0 or total == 0]
    one = sum(p.weight for p in micro_plan(mb, algo))
    assert sum(w for _, w in real) / world == pytest.approx(one)
    for rows, w in real:  # each piece weighs its share of the global minibatch's loss units
        assert w / world == pytest.approx(int(units[rows].sum()) / total if total else len(rows) / n)


def test_only_the_trainable_services_take_trainer_ranks() -> None:
    ok = parse_config({"services": {"actor": {"trainer_ranks": 4}, "critic": {"trainer_ranks": 2}}}, source="t")
    assert ok.endpoint("actor").trainer_ranks == 4 and ok.endpoint("reward").trainer_ranks == 1
    with pytest.raises(ConfigError, match=r"services\.reward\.trainer_ranks"):
        parse_config({"services": {"reward": {"trainer_ranks": 2}}}, source="t")
