"""Parity with TRL: one identical batch through rlfleet's `PolicyTrainer.train_step` and through TRL's own
`GRPOTrainer` (its `_generate_and_score_completions`, which computes the advantages, the trainer's old
log-probs and its vLLM importance-sampling ratio, then its `compute_loss` per micro-batch) gives the same
gradient, for each loss both name and each of TRL's engine-mismatch corrections, on-policy and after an
update (a second epoch, clipped against the policy that sampled the batch).

Only generation is not TRL's: its `rollout_func` hook hands TRL the batch, with "engine" log-probs that
differ from the trainer's (the mismatch a bf16 vLLM brings), so the correction has work to do."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from services.core.config.run import AlgoSection
from services.models.roles.tokenizer import build_tokenizer_from_vocab
from services.rl.batch import Rollout
from services.rl.pipeline import compute_advantages
from services.rl.trainer import PolicyTrainer
from tests.rl_helpers import tiny_qwen

trl = pytest.importorskip("trl", reason="TRL is the peer the parity is with")

PROMPTS, G, MICRO, MAX_NEW, TEMPERATURE, LR = 4, 4, 4, 6, 0.8, 0.5
ROWS = PROMPTS * G
NOISE = 0.6
# Equal rewards in the third group: a zero-std group, whose advantages are 0 in both.
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.1, 0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 0.0, 0.0]
# (TRL loss_type, its scale_rewards, rlfleet's algo fields): the losses both name.
LOSSES = {
    "dapo": ("group", {"name": "grpo", "loss_agg": "token_mean"}),
    "grpo": ("group", {"name": "grpo", "loss_agg": "seq_mean_token_mean"}),
    "dr_grpo": ("none", {"name": "dr_grpo", "loss_norm_len": MAX_NEW}),
}
MODES = ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate", None]


def _batch() -> tuple[Any, list[list[int]], list[list[int]], list[list[float]]]:
    """Prompts of 2-5 tokens, completions of 1-6 (some end in EOS, some are cut at the budget), and
    engine log-probs = the trainer's own plus a seeded error (sd 0.6 nats: far past bf16's, so that
    some tokens' and some responses' ratios pass the cap of 3 and every bound acts)."""
    tok = build_tokenizer_from_vocab([f"w{i}" for i in range(60)], "word")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 64, (2 + k % 4,), generator=g).tolist() for k in range(PROMPTS)]
    completions = []
    for i in range(ROWS):
        n = 1 + (i * 5) % MAX_NEW
        ids = torch.randint(4, 64, (n,), generator=g).tolist()
        if i % 3 == 0:
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    model = tiny_qwen()
    logps = []
    with torch.no_grad():
        for i, c in enumerate(completions):
            p = prompts[i // G]
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            noise = torch.randn(len(c), generator=g) * NOISE
            logps.append((lp + noise).tolist())
    return tok, prompts, completions, logps


def _trl_grads(loss_type: str, mode: str | None, epochs: int, tmp: Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    tok, prompts, completions, logps = _batch()
    texts = [tok.decode(p) for p in prompts]

    def rollout(batch_prompts: list[str], trainer: Any) -> dict[str, Any]:
        assert batch_prompts == [texts[i // G] for i in range(ROWS)]
        return {"prompt_ids": [prompts[i // G] for i in range(ROWS)], "completion_ids": completions,
                "logprobs": logps}

    def reward(prompts: list[str], completions: list[str], row: list[int], **_: Any) -> list[float]:
        return [REWARDS[i] for i in row]

    scale, _ = LOSSES[loss_type]
    args = GRPOConfig(
        output_dir=str(tmp), num_generations=G, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ROWS // MICRO, max_completion_length=MAX_NEW, temperature=TEMPERATURE,
        learning_rate=1e-5, beta=0.0, epsilon=0.2, loss_type=loss_type, scale_rewards=scale, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        vllm_importance_sampling_correction=mode is not None, vllm_importance_sampling_mode=mode or "sequence_mask",
        vllm_importance_sampling_clip_max=3.0,
    )
    model = tiny_qwen().train()
    ds = Dataset.from_dict({"prompt": texts * G, "row": list(range(ROWS))})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          rollout_func=rollout)
    # TRL applies its vLLM correction only with vLLM on: say so, without starting an engine (the batch is
    # the rollout function's, and there are no weights to sync).
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step
    trainer.current_gradient_accumulation_steps = ROWS // MICRO
    batch = trainer._generate_and_score_completions([{"prompt": texts[i // G], "row": i} for i in range(ROWS)])
    grads: list[torch.Tensor] = []
    for epoch in range(epochs):
        model.zero_grad(set_to_none=True)
        for mb in split_tensor_dict(batch, ROWS // MICRO):
            trainer.compute_loss(model, mb).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        if epoch + 1 < epochs:
            _sgd(model)
    return grads, batch["advantages"]


def _sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad


class _SGD:
    """Stands in for the trainer's AdamW: plain steps of LR, the same update TRL's side takes, so the
    second epoch starts from the same weights on both sides."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.grads = model, []  # type: ignore[var-annotated]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.grads.append([p.grad.detach().clone() for p in self.model.parameters()])
        _sgd(self.model)


def _rlfleet_grads(loss_type: str, mode: str | None, epochs: int, stale: bool = False,
                   ) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, float]]:
    """rlfleet's gradient of its last optimizer step: of `epochs` epochs over the batch, or (`stale`) of a
    second train_step on the same batch one version later, with algo.proximal "sampled"."""
    tok, prompts, completions, logps = _batch()
    p_width = max(len(p) for p in prompts)
    prompt_ids = torch.full((ROWS, p_width), tok.pad_token_id)
    prompt_mask = torch.zeros(ROWS, p_width, dtype=torch.bool)
    response_ids = torch.full((ROWS, MAX_NEW), tok.pad_token_id)
    response_mask = torch.zeros(ROWS, MAX_NEW, dtype=torch.bool)
    behaviour = torch.zeros(ROWS, MAX_NEW)
    for i, c in enumerate(completions):
        p = prompts[i // G]
        prompt_ids[i, p_width - len(p):], prompt_mask[i, p_width - len(p):] = torch.tensor(p), True
        response_ids[i, :len(c)], response_mask[i, :len(c)] = torch.tensor(c), True
        behaviour[i, :len(c)] = torch.tensor(logps[i])
    r = Rollout(task_ids=[f"t{i}" for i in range(ROWS)], prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                response_ids=response_ids, response_mask=response_mask, behaviour_logprobs=behaviour,
                group_ids=torch.arange(ROWS) // G, versions=torch.zeros(ROWS, dtype=torch.long),
                rewards=torch.tensor(REWARDS))
    _, fields = LOSSES[loss_type]
    algo = AlgoSection(**fields, group_size=G, kl_coef=0.0, clip_eps=0.2, ppo_epochs=epochs, minibatch_size=ROWS,
                       micro_batch_size=MICRO, lr=1e-5, max_grad_norm=1e9, compile=False,
                       behaviour_correction=mode or "none", behaviour_weight_cap=3.0,
                       proximal="sampled" if stale else "current")
    compute_advantages(r, algo, max_new_tokens=MAX_NEW)
    trainer = PolicyTrainer(tiny_qwen(), algo, temperature=TEMPERATURE)
    opt = _SGD(trainer.model)
    trainer.opt = opt  # type: ignore[assignment]
    stats = trainer.train_step(r, step=0, current_version=0)
    if stale:  # the batch sampled at version 0 arrives again at version 1
        stats = trainer.train_step(r, step=1, current_version=1)
        assert stats["proximal_sampled_rows"] == ROWS and stats["proximal_fallback_rows"] == 0
    assert r.advantages is not None
    return opt.grads[-1], r.advantages[:, 0], stats


def _cosine_and_ratio(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(float(x.double().pow(2).sum()) for x in a))
    nb = math.sqrt(sum(float(y.double().pow(2).sum()) for y in b))
    return dot / (na * nb), na / nb


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_an_on_policy_batch_gives_trls_gradient_for_each_loss_and_mismatch_correction(
    loss_type: str, mode: str | None, tmp_path: Path
) -> None:
    theirs, trl_adv = _trl_grads(loss_type, mode, 1, tmp_path)
    ours, our_adv, stats = _rlfleet_grads(loss_type, mode, 1)
    torch.testing.assert_close(our_adv.float(), trl_adv.float(), rtol=1e-5, atol=1e-6)
    cos, ratio = _cosine_and_ratio(ours, theirs)
    assert cos >= 0.9999 and abs(ratio - 1) <= 1e-3, (cos, ratio)
    if mode is not None:  # the mismatch is in the batch: the correction weights tokens, its bound acts
        assert stats["behaviour_weight_mean"] != pytest.approx(1.0, abs=1e-3)
        assert stats["behaviour_bounded_frac"] > 0


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_after_an_update_the_batch_is_clipped_against_the_policy_that_sampled_it_as_trl_clips(
    loss_type: str, mode: str, tmp_path: Path
) -> None:
    """TRL's second iteration over a generation batch (`num_iterations` 2) and rlfleet's second PPO epoch:
    both clip the moved policy against the trainer's log-probs at the weights that sampled the batch, and
    weight by the same engine correction."""
    theirs, _ = _trl_grads(loss_type, mode, 2, tmp_path)
    ours, _, stats = _rlfleet_grads(loss_type, mode, 2)
    assert stats["clip_frac"] > 0  # the update moved the policy past the clip for some tokens
    cos, ratio = _cosine_and_ratio(ours, theirs)
    assert cos >= 0.9999 and abs(ratio - 1) <= 1e-3, (cos, ratio)
    # The same batch at one epoch is another gradient: the comparison can tell the two apart.
    first, _, _ = _rlfleet_grads(loss_type, mode, 1)
    assert _cosine_and_ratio(first, theirs)[0] < 0.9999


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_a_stale_batch_clipped_against_the_weights_that_sampled_it_is_trls_second_pass(
    mode: str, tmp_path: Path
) -> None:
    """algo.proximal "sampled": a batch one version old is clipped against the trainer's log-probs at the
    version that sampled it (kept by the trainer), weighted by the engine correction alone: TRL's
    objective on its second iteration over a generation batch."""
    theirs, _ = _trl_grads("dapo", mode, 2, tmp_path)
    ours, _, stats = _rlfleet_grads("dapo", mode, 1, stale=True)
    assert stats["clip_frac"] > 0 and stats["off_policy"] == 1.0
    cos, ratio = _cosine_and_ratio(ours, theirs)
    assert cos >= 0.9999 and abs(ratio - 1) <= 1e-3, (cos, ratio)


def test_each_correction_is_a_gradient_of_its_own() -> None:
    """The comparison can fail: rlfleet under another mode than TRL's is far from TRL's gradient."""
    grads = {m: _rlfleet_grads("dapo", m, 1)[0] for m in MODES}
    for a in MODES:
        for b in MODES:
            if a != b:
                assert _cosine_and_ratio(grads[a], grads[b])[0] < 0.9999 or abs(
                    _cosine_and_ratio(grads[a], grads[b])[1] - 1) > 1e-3, (a, b)


def test_trl_and_rlfleet_draw_the_same_batch() -> None:
    """The fixture itself: variable prompt and completion lengths, EOS and cut rows, a real mismatch."""
    tok, prompts, completions, logps = _batch()
    assert len({len(p) for p in prompts}) > 1 and len({len(c) for c in completions}) > 1
    assert any(c[-1] == tok.eos_token_id for c in completions)
    assert any(len(c) == MAX_NEW and c[-1] != tok.eos_token_id for c in completions)
    assert copy.deepcopy(logps) == _batch()[3]
    # Each bound acts on some rows but not all: ratios pi_trainer / pi_engine above the cap of 3.
    model = tiny_qwen()
    tok_over, seq_over = 0, 0
    with torch.no_grad():
        for i, c in enumerate(completions):
            p = prompts[i // G]
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            diff = lp - torch.tensor(logps[i])
            tok_over += int((diff > math.log(3)).sum())
            seq_over += int(diff.sum() > math.log(3))
    assert 0 < tok_over < sum(map(len, completions)) and 0 < seq_over < ROWS
