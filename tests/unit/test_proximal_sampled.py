"""algo.proximal "sampled": the trainer keeps the trainable weights of the last versions and scores a
stale batch at the version that sampled it (TRL's parity for it is in test_trl_parity.py)."""

from __future__ import annotations

import pytest
import torch

from services.core.config.run import AlgoSection
from services.rl.trainer import PolicyTrainer, WeightVersions
from tests.rl_helpers import ragged_rollout, tiny_qwen


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_weight_versions_keep_the_last_versions_and_swap_them_in_and_back() -> None:
    model = tiny_qwen()
    kept = WeightVersions(model, keep=2)
    at: dict[int, list[torch.Tensor]] = {}
    for v in range(3):
        kept.keep(v)
        at[v] = _params(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (v + 1))
    now = _params(model)
    assert not kept.has(0) and kept.has(1) and kept.has(2)  # the oldest past the limit is dropped
    with kept.swapped_in(1):
        assert _same(_params(model), at[1])
    assert _same(_params(model), now)
    kept.keep(2)  # a version already kept stays as it was kept
    with kept.swapped_in(2):
        assert _same(_params(model), at[2])


def _algo(proximal: str) -> AlgoSection:
    return AlgoSection(name="grpo", group_size=2, minibatch_size=6, lr=1e-3, compile=False, proximal=proximal,
                       behaviour_correction="token_truncate", behaviour_weight_cap=3.0)


def test_a_stale_batch_whose_version_is_not_kept_is_scored_at_the_current_weights_and_counted() -> None:
    r = ragged_rollout([0, 0, 0, 0, 1, 1], with_ref=False)
    sampled = PolicyTrainer(tiny_qwen(), _algo("sampled"), temperature=1.0)
    current = PolicyTrainer(tiny_qwen(), _algo("current"), temperature=1.0)
    stats = sampled.train_step(r, step=0, current_version=2)  # a fresh trainer (a restart) keeps no version
    assert stats["proximal_fallback_rows"] == 6 and stats["proximal_sampled_rows"] == 0
    ref = current.train_step(r, step=0, current_version=2)
    assert stats["policy_loss"] == pytest.approx(ref["policy_loss"], rel=1e-5)
    assert all(torch.allclose(x, y, atol=1e-6)
               for x, y in zip(_params(sampled.model), _params(current.model), strict=True))


def test_a_stale_batch_is_clipped_against_the_kept_version_not_the_current_weights() -> None:
    r = ragged_rollout([0] * 6, with_ref=False)
    trainer = PolicyTrainer(tiny_qwen(), _algo("sampled"), temperature=1.0)
    first = trainer.train_step(r, step=0, current_version=0)  # keeps version 0, then updates
    assert "proximal_sampled_rows" in first and first["proximal_sampled_rows"] == 0
    again = trainer.train_step(r, step=1, current_version=1)
    assert again["proximal_sampled_rows"] == 6 and again["proximal_fallback_rows"] == 0
    # Clipped against version 0, the ratio has moved away from 1; against the current weights it is 1.
    assert again["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_proximal_sampled_refuses_a_sharded_trainer() -> None:
    with pytest.raises(ValueError, match="one trainer rank only"):
        PolicyTrainer(tiny_qwen(), _algo("sampled"), temperature=1.0, ranks=2)
