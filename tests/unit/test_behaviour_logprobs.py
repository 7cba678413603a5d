"""generation.behaviour_logprobs "trainer" (issue 16): the engine computes no per-token log-probs and the
trainer's no-grad proximal forward is PPO's `old` on every batch, with no behaviour weight. What needs
behaviour log-probs is refused at config time; the rollout's KL metric is left out instead of
reporting KL from zeros."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2ForCausalLM

from services.core.config.run import AlgoSection, ConfigError, parse_config
from services.models.engine import SamplingParams
from services.models.engines.vllm_adapter import sampling_kwargs
from services.models.nets.logprobs import response_logprobs
from services.rl.batch import Rollout
from services.rl.pipeline import batch_stats, compute_advantages
from services.rl.trainer import PolicyTrainer
from tests.rl_helpers import ragged_rollout, tiny_qwen

TEMPERATURE = 0.9

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- config ------------------------------------------------------------------------------------------
def test_trainer_logprobs_refuse_a_kl_penalty_in_the_reward_naming_both_fields() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"generation": {"behaviour_logprobs": "trainer"}, "algo": {"kl_coef": 0.1, "kl_in": "reward"}})
    assert "generation.behaviour_logprobs" in str(e.value) and "algo.kl_in" in str(e.value)
    # KL in the loss compares the trainer's own log-probs with the reference's: allowed.
    cfg = parse_config({"generation": {"behaviour_logprobs": "trainer"}, "algo": {"kl_coef": 0.1, "kl_in": "loss"}})
    assert cfg.generation.behaviour_logprobs == "trainer"
    assert parse_config({}).generation.behaviour_logprobs == "engine"


def test_sampling_params_refuse_a_non_bool_logprobs_switch() -> None:
    with pytest.raises(ValueError, match="logprobs must be a bool"):
        SamplingParams(logprobs=0)  # type: ignore[arg-type]


# -- vLLM's request ----------------------------------------------------------------------------------
def test_vllm_requests_ask_for_the_sampled_logprob_only_when_wanted() -> None:
    on = sampling_kwargs(SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, stop_token_ids=(3,)), (2,), 11)
    off = sampling_kwargs(SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, stop_token_ids=(3,),
                                         logprobs=False), (2,), 11)
    assert on["logprobs"] == 0 and on["flat_logprobs"] is True
    assert "logprobs" not in off and "flat_logprobs" not in off  # vLLM's default: none
    assert {k: v for k, v in on.items() if k not in ("logprobs", "flat_logprobs")} == off
    assert off["stop_token_ids"] == [2, 3] and off["seed"] == 11 and off["max_tokens"] == 9


# -- trainer -----------------------------------------------------------------------------------------
def _model() -> Qwen2ForCausalLM:
    return tiny_qwen()


def _rollout(versions: list[int]) -> Rollout:
    r = ragged_rollout(versions, with_ref=False)
    r.behaviour_logprobs = torch.zeros_like(r.behaviour_logprobs)  # what a "trainer" rollout carries
    return r


def _train(r: Rollout, mode: str, current_version: int, **algo: object) -> tuple[list[torch.Tensor], dict[str, float]]:
    # Two minibatches and two epochs: after the first update the ratio is no longer 1, so `old` matters.
    a = AlgoSection(name="grpo", minibatch_size=3, ppo_epochs=2, lr=1e-2, clip_eps=0.05, **algo)  # type: ignore[arg-type]
    t = PolicyTrainer(copy.deepcopy(_model()), a, temperature=TEMPERATURE, behaviour_logprobs=mode)  # type: ignore[arg-type]
    stats = t.train_step(r, step=0, current_version=current_version)
    return [p.detach().clone() for p in t.model.parameters()], stats


def _exact_behaviour(r: Rollout) -> Rollout:
    """`r` with the log-probs the engine would have reported for it under `_model()`'s weights."""
    out = copy.copy(r)
    with torch.no_grad():
        lp = response_logprobs(_model(), r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask,
                               temperature=TEMPERATURE)
    out.behaviour_logprobs = torch.where(r.response_mask, lp, torch.zeros_like(lp))
    return out


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b, strict=True)) ** 0.5
    den = sum(float(x.norm() ** 2) for x in a) ** 0.5
    assert num / den < tol, (num, den)


def test_trainer_mode_on_policy_step_equals_an_engine_step_fed_exact_behaviour_logprobs() -> None:
    r = _rollout([0] * 6)
    engine_params, engine_stats = _train(_exact_behaviour(r), "engine", current_version=0)
    trainer_params, trainer_stats = _train(r, "trainer", current_version=0)  # zeros: the proximal forward is `old`
    _assert_same(engine_params, trainer_params)
    for k in ("policy_loss", "clip_frac", "approx_kl", "ratio_mean", "entropy", "grad_norm"):
        assert trainer_stats[k] == pytest.approx(engine_stats[k], rel=1e-4, abs=1e-6), k
    assert engine_stats["clip_frac"] > 0  # the second epoch clips: `old` really shaped the update
    # Fed zeros as behaviour log-probs, the engine mode's step is another one.
    wrong, _ = _train(r, "engine", current_version=0)
    with pytest.raises(AssertionError):
        _assert_same(wrong, trainer_params)


def test_trainer_mode_off_policy_step_applies_no_behaviour_weight() -> None:
    r = _rollout([0, 0, 1, 1, 1, 1])  # rows of version 0 are a version behind
    noisy = copy.copy(r)
    noisy.behaviour_logprobs = -torch.rand(r.response_ids.shape, generator=torch.Generator().manual_seed(2)) * 3
    params, stats = _train(r, "trainer", current_version=1)
    assert stats["off_policy"] == 1.0 and stats["behaviour_weight_mean"] == 1.0
    # Whatever the rollout carries as behaviour log-probs, a "trainer" step never reads them ...
    _assert_same(params, _train(noisy, "trainer", current_version=1)[0], tol=1e-7)
    # ... where the engine mode weights by them (decoupled PPO).
    assert _train(noisy, "engine", current_version=1)[1]["behaviour_weight_mean"] != pytest.approx(1.0)


# -- the rollout's KL metric -------------------------------------------------------------------------
def test_trainer_mode_leaves_the_kl_metric_out_instead_of_reporting_kl_from_zeros() -> None:
    algo = AlgoSection(name="grpo", kl_coef=0.1, kl_in="loss")
    r = _rollout([0] * 6)
    r.rewards, r.ref_logprobs = torch.arange(6.0), -torch.rand(r.response_ids.shape)
    assert "kl" in compute_advantages(copy.copy(r), algo)
    stats = compute_advantages(r, algo, behaviour_logprobs="trainer")
    assert "kl" not in stats and "reward_mean" in stats
    assert "kl" not in batch_stats(r, algo, behaviour_logprobs="trainer")
    with pytest.raises(ValueError, match="behaviour_logprobs"):  # past the config check: still no penalty from zeros
        compute_advantages(r, AlgoSection(name="grpo", kl_coef=0.1, kl_in="reward"), behaviour_logprobs="trainer")


# -- one optimizer step per batch: no separate proximal pass ----------------------------------------------
class _Counting(PolicyTrainer):
    """Counts the model's forward passes; `always_proximal` takes the separate no-grad pass regardless."""

    def __init__(self, *a: object, always_proximal: bool = False, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.always_proximal, self.forwards = always_proximal, 0
        self.model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def weights_move_within(self, rows: int) -> bool:
        return self.always_proximal or super().weights_move_within(rows)


@pytest.mark.parametrize("mode", ["trainer", "engine"])
def test_one_update_per_batch_takes_each_forwards_own_logprobs_as_proximal_and_trains_the_same(mode: str) -> None:
    # A one-step-stale batch, one epoch, one minibatch (rlfleet's GRPO on the H200 bench): the weights do
    # not move until the batch's only optimizer step, so the no-grad proximal pass recomputes what each
    # micro-batch's training forward computes anyway (a quarter of the trainer's FLOPs at 1.5B).
    r = _rollout([3, 3, 2, 3, 2, 3])
    if mode == "engine":
        r = _exact_behaviour(r)
        r.behaviour_logprobs = r.behaviour_logprobs - 0.05 * r.response_mask  # a slightly older behaviour
    a = AlgoSection(name="grpo", minibatch_size=len(r), ppo_epochs=1, micro_batch_size=2, lr=1e-2, clip_eps=0.05)
    got = []
    for always in (False, True):
        t = _Counting(copy.deepcopy(_model()), a, temperature=TEMPERATURE, behaviour_logprobs=mode,
                      always_proximal=always)
        stats = t.train_step(r, step=0, current_version=3)
        got.append(([p.detach().clone() for p in t.model.parameters()], stats, t.forwards))
    (fast, fast_stats, fast_fwd), (slow, slow_stats, slow_fwd) = got
    assert fast_stats["proximal_forward"] == 0.0 and slow_stats["proximal_forward"] == 1.0
    assert fast_stats["off_policy"] == slow_stats["off_policy"] == 1.0
    assert (fast_fwd, slow_fwd) == (3, 6)  # three micro-batches of two; the slow path scores them first
    for x, y in zip(fast, slow, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert fast_stats["policy_loss"] == pytest.approx(slow_stats["policy_loss"], abs=1e-6)


def test_several_updates_per_batch_still_score_the_proximal_policy_first() -> None:
    # Two epochs (or two minibatches): the second update's forward runs on moved weights, so `old` must
    # come from the pass before the first update.
    r = _rollout([3, 3, 2, 3, 2, 3])
    # Forwards: the proximal pass (3 micro-batches of two), then the training ones (2 epochs x 3, or
    # 2 minibatches of three rows cut into micro-batches of two and one).
    cases = (({"ppo_epochs": 2, "minibatch_size": 6}, 3 + 6), ({"ppo_epochs": 1, "minibatch_size": 3}, 3 + 4))
    for algo, forwards in cases:
        a = AlgoSection(name="grpo", micro_batch_size=2, lr=1e-2, **algo)  # type: ignore[arg-type]
        t = _Counting(copy.deepcopy(_model()), a, temperature=TEMPERATURE, behaviour_logprobs="trainer")
        stats = t.train_step(r, step=0, current_version=3)
        assert stats["proximal_forward"] == 1.0 and t.forwards == forwards, (algo, t.forwards)
