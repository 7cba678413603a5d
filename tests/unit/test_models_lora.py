"""LoRA through peft: only the adapters train (gradient checkpointing too), the engine gets peft's
merge of them, a checkpoint holds the adapters and resumes bit for bit, and both exports load
with plain transformers / peft and score like the trainer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.core.config.run import AlgoSection, ConfigError, LoraSpec, parse_config
from services.models.checkpoints.checkpoint import CheckpointMismatch, load_latest, save_checkpoint
from services.models.checkpoints.export import ExportError, export_model, record_local_config
from services.models.engine import SamplingParams, WeightSyncError
from services.models.engines.factory import make_engine
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import response_logprobs
from services.models.nets.lora import (
    adapter_state,
    apply_lora,
    check_only_adapters_train,
    engine_weights,
    load_adapter_state,
    load_policy,
)
from services.preflight import PreflightError, check_models
from services.rl.trainer import PolicyTrainer
from services.tasks import load_task
from services.workers.trainable import Trainable, WeightsRefused
from tests.fleet_helpers import tiny_config
from tests.unit.test_rl_trainer import _rollout

SPEC = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
ALGO = AlgoSection(name="grpo", minibatch_size=4, lr=1e-2, max_grad_norm=1e9, kl_coef=0.0)


def _tiny() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=40, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _rollout32(vocab: int = 40):  # type: ignore[no-untyped-def]
    r = _rollout()
    r.prompt_ids, r.response_ids = r.prompt_ids % vocab, r.response_ids % vocab
    for name in ("behaviour_logprobs", "advantages", "returns", "values", "ref_logprobs"):
        setattr(r, name, getattr(r, name).float())
    return r


def _train(model: torch.nn.Module, steps: int = 1, **kw: bool) -> PolicyTrainer:
    trainer = PolicyTrainer(model, ALGO, temperature=1.0, **kw)
    for s in range(steps):
        trainer.train_step(_rollout32(), step=s, current_version=s)
    return trainer


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_lora_step_moves_the_adapters_and_nothing_else(checkpointing: bool) -> None:
    model = apply_lora(_tiny(), SPEC, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _train(model, gradient_checkpointing=checkpointing)
    assert model.get_base_model().is_activation_checkpointing == checkpointing  # enabled through the peft wrapper
    check_only_adapters_train(model, trainer.opt)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n in before if "lora_" in n}
    # lora_A moves only once B is non-zero (B starts at 0), so one step moves every B and no base weight.
    assert moved and moved <= adapters and {n for n in adapters if "lora_B" in n} <= moved


def test_the_optimizer_check_refuses_a_base_weight() -> None:
    model = apply_lora(_tiny(), SPEC, seed=0)
    base = next(p for n, p in model.named_parameters() if "lora_" not in n)
    opt = torch.optim.AdamW([*(p for p in model.parameters() if p.requires_grad), base])
    with pytest.raises(AssertionError, match="adapter parameters and nothing else"):
        check_only_adapters_train(model, opt)


def test_merged_weights_are_peft_merge_and_unload_under_the_base_names() -> None:
    names = {k: tuple(v.shape) for k, v in _tiny().state_dict().items()}
    model = apply_lora(_tiny(), SPEC, seed=0)
    _train(model, steps=2)
    trainer_before = {k: v.clone() for k, v in model.state_dict().items()}
    got = dict(engine_weights(model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert {k: tuple(v.shape) for k, v in got.items()} == names == {k: tuple(v.shape) for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], trainer_before[f"base_model.model.{q[:-7]}.base_layer.weight"])
    # The trainer stays unmerged, bit for bit.
    assert all(torch.equal(v, trainer_before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_merge_rounds_as_peft_does(dtype: torch.dtype) -> None:
    model = apply_lora(_tiny().to(dtype), SPEC, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    got = dict(engine_weights(model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(got[k].dtype == want[k].dtype == dtype and torch.equal(got[k], want[k]) for k in want)


def test_the_engine_after_a_sync_scores_like_the_merged_trainer(tiny_model: Path) -> None:
    spec = parse_config({"models": {"policy": {"path": str(tiny_model), "lora": {"r": 4}}}}).models.policy
    policy = load_policy(spec, tiny_model, "cpu", seed=0)
    tok = load_tokenizer(tiny_model)
    with torch.no_grad():  # a trained adapter: random B, so the merge really changes the weights
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(n) % 1000))
    engine = make_engine("transformers", tiny_model)
    prompts = [tok("3+4=", add_special_tokens=False)["input_ids"], tok("12+5=", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=7)

    def gaps() -> float:
        comps = engine.generate(prompts, params)
        worst = 0.0
        for p, c in zip(prompts, comps, strict=True):
            with torch.no_grad():
                lp = response_logprobs(policy, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.bool),
                                       torch.tensor([c.token_ids]), torch.ones(1, len(c.token_ids), dtype=torch.bool))
            worst = max(worst, float((lp[0] - torch.tensor(c.logprobs)).abs().max()))
        return worst

    assert gaps() > 1e-3  # the engine still serves the base: the check below can fail
    engine.update_weights(engine_weights(policy), version=1)
    assert gaps() < 1e-5


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    model = apply_lora(_tiny(), SPEC, seed=0)
    trainer = _train(model, steps=2)
    path = save_checkpoint(tmp_path, "actor", version=2, step=2, model=model, optimizer=trainer.opt)
    from safetensors.torch import load_file

    assert set(load_file(str(path / "model.safetensors"))) == set(adapter_state(model))
    trainer.train_step(_rollout32(), step=2, current_version=2)  # uninterrupted: one more step

    resumed = apply_lora(_tiny(), SPEC, seed=99)  # other adapter init until the checkpoint says otherwise
    resumed_trainer = PolicyTrainer(resumed, ALGO, temperature=1.0)
    meta = load_latest(tmp_path, "actor", resumed, resumed_trainer.opt)
    assert meta is not None and meta.version == 2
    resumed_trainer.train_step(_rollout32(), step=2, current_version=2)
    a, b = model.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A full-model (non-LoRA) policy cannot load an adapter checkpoint: a mismatch, not a silent load.
    with pytest.raises(CheckpointMismatch):
        load_latest(tmp_path, "actor", _tiny(), None)


def test_update_weights_loads_a_lora_checkpoint_and_refuses_a_plain_model_dir(tmp_path: Path) -> None:
    src = apply_lora(_tiny(), SPEC, seed=0)
    trainer = _train(src, steps=2)
    ckpt = save_checkpoint(tmp_path / "ckpt", "actor", 2, 2, src, trainer.opt)
    dst = apply_lora(_tiny(), SPEC, seed=5)
    t = Trainable(parse_config({"run": {"dir": str(tmp_path / "run")}}), "actor", dst,
                  PolicyTrainer(dst, ALGO, temperature=1.0).opt)
    assert t.load_weights(ckpt, 2) == 2
    a, b = src.state_dict(), dst.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = tmp_path / "plain"
    _tiny().save_pretrained(plain)
    with pytest.raises(WeightsRefused, match="loads its adapters from its own checkpoints only"):
        t.load_weights(plain, 3)


def test_adapter_weights_that_do_not_fit_are_refused_naming_them() -> None:
    model = apply_lora(_tiny(), SPEC, seed=0)
    state = adapter_state(model)
    name = next(iter(state))
    with pytest.raises(WeightSyncError, match="missing names"):
        load_adapter_state(model, {k: v for k, v in state.items() if k != name})
    with pytest.raises(WeightSyncError, match="unknown names: nope"):
        load_adapter_state(model, {**state, "nope": torch.zeros(1)})


def test_a_target_the_model_lacks_is_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as err:
        apply_lora(_tiny(), LoraSpec(target_modules=["q_proj", "qkv"]), seed=0)
    msg = str(err.value)
    assert "'qkv' is not a linear layer of Qwen2ForCausalLM" in msg and "q_proj" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="'lm_head' is not a linear layer"):  # tied to the embedding
        apply_lora(_tiny(), LoraSpec(target_modules=["lm_head"]), seed=0)


@pytest.mark.parametrize("bad, says", [
    ({"policy": {"build": {}, "lora": {"r": 0}}}, "models.policy.lora.r"),
    ({"policy": {"build": {}, "lora": {"target_modules": []}}}, "name at least one module"),
    ({"policy": {"build": {}}, "critic": {"path": "/m", "lora": {}}}, "only models.policy trains LoRA"),
])
def test_bad_lora_config_names_the_field(bad: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_config({"models": bad})


def test_exports_merged_and_adapter_load_and_score_like_the_trainer(tiny_model: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_model)
    data = cfg.model_dump(mode="json")
    data["models"]["policy"]["lora"] = {"r": 4, "alpha": 8.0}
    cfg = parse_config(yaml.safe_load(yaml.safe_dump(data)))
    policy = load_policy(cfg.models.policy, tiny_model, "cpu", seed=0)
    vocab = int(policy.config.vocab_size)
    trainer = PolicyTrainer(policy, ALGO, temperature=1.0)
    for s in range(2):
        trainer.train_step(_rollout32(vocab), step=s, current_version=s)
    save_checkpoint(cfg.checkpoint_dir, "actor", 1, 1, policy, trainer.opt)
    record_local_config(cfg, tiny_model)

    ids = torch.arange(8).reshape(2, 4) % vocab
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        want = response_logprobs(policy, ids, mask, ids, mask)
        base = response_logprobs(load_causal_lm(tiny_model), ids, mask, ids, mask)
    assert (want - base).abs().max() > 1e-4  # the adapters moved the policy

    merged = export_model(cfg.run_dir, tmp_path / "merged").out
    adapter = export_model(cfg.run_dir, tmp_path / "adapter", lora="adapter").out
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), adapter).eval()
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    with torch.no_grad():
        # The adapter export computes as the trainer does; the merged one rounds (W + BA)x, not Wx + B(Ax).
        assert torch.allclose(response_logprobs(peft_model, ids, mask, ids, mask), want, atol=1e-6, rtol=0)
        assert torch.allclose(response_logprobs(plain, ids, mask, ids, mask), want, atol=1e-5, rtol=0)

    full = tiny_config(tmp_path / "full", tiny_model)
    save_checkpoint(full.checkpoint_dir, "actor", 1, 1, load_causal_lm(tiny_model), None)
    record_local_config(full, tiny_model)
    with pytest.raises(ExportError, match="trained no LoRA adapter"):
        export_model(full.run_dir, tmp_path / "nope", lora="adapter")



def test_preflight_names_a_lora_target_the_model_has_no_module_for(tiny_model: Path, tmp_path: Path) -> None:
    def cfg(targets: list[str]):  # type: ignore[no-untyped-def]
        data = tiny_config(tmp_path / "run", tiny_model).model_dump(mode="json")
        data["models"]["policy"]["lora"] = {"target_modules": targets}
        return parse_config(data)

    good = cfg(["q_proj", "down_proj"])
    check_models(good, load_task(good.task))
    bad = cfg(["q_proj", "qkv_proj"])
    with pytest.raises(PreflightError, match="has no module named 'qkv_proj'"):
        check_models(bad, load_task(bad.task))
