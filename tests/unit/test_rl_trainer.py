"""PolicyTrainer / ValueTrainer: micro-batching (by rows, by token budget, packed) accumulates exactly
the minibatch's gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.core.config.run import AlgoSection
from services.models.nets.critic import ValueModel
from services.rl.batch import Rollout
from services.rl.trainer import PolicyTrainer, ValueTrainer, micro_weights
from tests.rl_helpers import with_statistics_read_once


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=40, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).to(torch.float64).eval()


def _rollout(b: int = 8, p: int = 4, r: int = 5) -> Rollout:
    g = torch.Generator().manual_seed(1)
    # Ragged prompts (left padding) and responses (right padding), one response empty: real lengths
    # 4, 4, 8, 5, 3, 7, 9, 5, so a 9-wide packed row holds a 5 and a 4.
    plen, rlen = [4, 2, 3, 4, 1, 3, 4, 2], [0, 2, 5, 1, 2, 4, 5, 3]
    prompt_mask = torch.arange(p)[None, :] >= p - torch.tensor(plen[:b])[:, None]
    resp_mask = torch.arange(r)[None, :] < torch.tensor(rlen[:b])[:, None]
    return Rollout(
        task_ids=[f"t{i}" for i in range(b)],
        prompt_ids=torch.randint(1, 40, (b, p), generator=g), prompt_mask=prompt_mask,
        response_ids=torch.randint(1, 40, (b, r), generator=g), response_mask=resp_mask,
        behaviour_logprobs=-torch.rand(b, r, generator=g, dtype=torch.float64) * 3,
        group_ids=torch.arange(b) // 2,
        advantages=torch.randn(b, r, generator=g, dtype=torch.float64),
        returns=torch.randn(b, r, generator=g, dtype=torch.float64),
        values=torch.randn(b, r, generator=g, dtype=torch.float64),
        ref_logprobs=-torch.rand(b, r, generator=g, dtype=torch.float64) * 3,
    )


def _assert_same_update(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    # Log-probs are taken in float32 whatever the model dtype, so the match is to float32 rounding;
    # a wrong micro-batch weighting is off by O(1) in relative norm.
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b, strict=True)) ** 0.5
    den = sum(float(x.norm() ** 2) for x in a) ** 0.5
    assert den > 0 and num / den < tol, (num, den)


def _sgd_delta(trainer: PolicyTrainer | ValueTrainer, run) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    trainer.opt = torch.optim.SGD(params, lr=1.0)  # the update is the gradient itself
    run()
    return [b - p.detach() for b, p in zip(before, params, strict=True)]


AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
# The whole minibatch at once, then 3 rows at a time, an 18-token budget (several micro-batches, each
# cut to its own width), and the same packed (two 9-wide rows per micro-batch, some holding two sequences).
SPLITS = [{"micro_batch_size": 3}, {"micro_batch_tokens": 18}, {"micro_batch_tokens": 18, "pack_sequences": True}]


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_accumulate_the_minibatch_gradient(agg: str) -> None:
    r = _rollout()
    deltas = []
    for split in [{}, *SPLITS]:
        # versions < current_version: the proximal log-probs are recomputed through the same plan.
        algo = AlgoSection(name="grpo", minibatch_size=8, loss_agg=agg,  # type: ignore[arg-type]
                           kl_coef=0.1, kl_in="loss", entropy_coef=0.01, max_grad_norm=1e9, **split)
        t = PolicyTrainer(copy.deepcopy(_model()), algo, temperature=0.7)
        deltas.append(_sgd_delta(t, lambda t=t: t.train_step(r, step=0, current_version=1)))
    for d in deltas[1:]:
        _assert_same_update(deltas[0], d)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum_norm"])
def test_value_micro_batches_accumulate_the_minibatch_gradient(agg: str) -> None:
    r = _rollout()
    deltas, scores = [], []
    for split in [{}, *SPLITS]:
        algo = AlgoSection(name="ppo", minibatch_size=8, max_grad_norm=1e9, loss_agg=agg, **split)  # type: ignore[arg-type]
        torch.manual_seed(0)
        t = ValueTrainer(ValueModel(_model().model.float()), algo)
        torch.nn.init.normal_(t.model.value_head.weight)  # a zero head scores every plan the same
        scores.append(t.score(r))
        deltas.append(_sgd_delta(t, lambda t=t: t.train_step(r, step=0)))
    for d, v in zip(deltas[1:], scores[1:], strict=True):
        _assert_same_update(deltas[0], d, tol=1e-4)
        torch.testing.assert_close(v, scores[0], atol=1e-5, rtol=0)


def test_a_critic_step_reads_its_statistics_back_once_per_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the policy's (test_trainer_levers): a read per micro-batch waits for the GPU each time.
    # Minibatches of 4 rows in micro-batches of 3 and 1: two optimizer steps, one read each.
    algo = AlgoSection(name="ppo", minibatch_size=4, micro_batch_size=3, value_clip=0.2)
    torch.manual_seed(0)
    t = ValueTrainer(ValueModel(_model().model.float()), algo)
    torch.nn.init.normal_(t.model.value_head.weight)
    expected = copy.deepcopy(t).train_step(_rollout(), step=0)
    stats, reads = with_statistics_read_once(monkeypatch, lambda: t.train_step(_rollout(), step=0))
    assert len(reads) == 2 and all({"value_loss", "vf_clip_frac", "value_mean"} <= set(r) for r in reads)
    assert stats == pytest.approx(expected, rel=1e-12) and 0 < stats["vf_clip_frac"] < 1


def test_micro_weights_split_by_tokens_or_responses() -> None:
    r = _rollout()
    tok = micro_weights(r, 3, "token_mean")
    seq = micro_weights(r, 3, "seq_mean_token_mean")
    assert [len(c) for c, _ in tok] == [3, 3, 2]
    assert sum(w for _, w in tok) == pytest.approx(1.0)
    assert sum(w for _, w in seq) == pytest.approx(1.0)
    counts = r.response_mask.sum(1)
    assert tok[0][1] == pytest.approx(float(counts[:3].sum() / counts.sum()))
    assert micro_weights(r, 0, "token_mean")[0][1] == 1.0 and len(micro_weights(r, 100, "token_mean")) == 1


def test_rollout_moves_every_tensor_to_a_device() -> None:
    r = _rollout().to("meta")
    assert all(t.device.type == "meta" for t in (r.prompt_ids, r.advantages, r.values, r.group_ids))
    assert r.task_ids == _rollout().task_ids
