"""The trainer's speed levers (issue 16) change how fast a step runs, not what it computes: a step with
chunked log-probs, the fused AdamW (the default) or a compiled decoder moves the weights as the default step does."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import Qwen2ForCausalLM

from services.core.config.run import AlgoSection
from services.reference.scorer import ReferenceScorer
from services.rl.batch import Rollout
from services.rl.trainer import PolicyTrainer
from tests.rl_helpers import ragged_rollout, tiny_qwen, with_statistics_read_once

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(layers: int = 2) -> Qwen2ForCausalLM:
    return tiny_qwen(layers)


def _rollout() -> Rollout:
    return ragged_rollout([0, 0, 1, 1, 1, 1])


def _train(steps: int = 2, **levers: object) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    algo = AlgoSection(name="grpo", minibatch_size=6, micro_batch_size=4, kl_coef=0.1, kl_in="loss",
                       entropy_coef=0.01, lr=1e-2, **levers)  # type: ignore[arg-type]
    t = PolicyTrainer(copy.deepcopy(_model()), algo, temperature=0.9)
    r = _rollout()
    # current_version 1: rows of version 0 are off-policy, so the no-grad proximal forward runs too.
    stats = [t.train_step(r, step=s, current_version=1) for s in range(steps)]
    return [p.detach().clone() for p in t.model.parameters()], stats


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b, strict=True)) ** 0.5
    den = sum(float(x.norm() ** 2) for x in a) ** 0.5
    assert num / den < tol, (num, den)


def test_chunked_logprob_steps_move_the_weights_as_whole_vocabulary_steps() -> None:
    base, base_stats = _train()
    chunked, stats = _train(logprob_chunk_tokens=3)
    _assert_same(base, chunked)
    for k in ("policy_loss", "kl_loss", "entropy", "grad_norm"):
        assert stats[-1][k] == pytest.approx(base_stats[-1][k], rel=1e-4, abs=1e-6), k
    assert _train(steps=1)[0][0].ne(_model().model.embed_tokens.weight).any()  # the steps do move weights


def test_the_default_fused_adamw_steps_equal_torchs_loop_adamw() -> None:
    loop, _ = _train(steps=3, fused_optimizer=False)
    fused, _ = _train(steps=3)
    _assert_same(loop, fused, tol=1e-5)
    assert PolicyTrainer(_model(), AlgoSection(), temperature=1.0).opt.defaults["fused"] is True
    assert not PolicyTrainer(_model(), AlgoSection(fused_optimizer=False), temperature=1.0).opt.defaults["fused"]


def test_chunked_reference_scores_equal_the_whole_vocabulary_scores() -> None:
    r = _rollout()
    whole = ReferenceScorer(_model(), temperature=0.9, micro_batch=4).score(r)
    chunked = ReferenceScorer(_model(), temperature=0.9, micro_batch=4, chunk_tokens=2).score(r)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_compile_flag_compiles_each_decoder_layer_of_the_trainer_and_the_reference() -> None:
    t = PolicyTrainer(_model(layers=2), AlgoSection(compile=True), temperature=1.0)
    ref = ReferenceScorer(_model(layers=2), temperature=1.0, compile=True)
    for m in (t.model, ref.model):
        # Block by block (one compiled code for every layer), never the LM head.
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in m.model.layers)
        assert getattr(m.lm_head, "_compiled_call_impl", None) is None
        assert "model.embed_tokens.weight" in m.state_dict()  # names unchanged: weight syncs still match
        assert "model.layers.1.mlp.up_proj.weight" in m.state_dict()


def test_a_decoder_without_repeated_blocks_is_compiled_whole() -> None:
    from services.models.nets.logprobs import compile_decoder

    model = _model(layers=1)
    compile_decoder(model, backend="aot_eager")
    assert getattr(model.model, "_compiled_call_impl", None) is not None


def test_compiled_step_equals_the_eager_step() -> None:
    # Inductor's C++ code generation takes minutes per graph on this CI's two shared cores, so the
    # check runs the same dynamo capture and AOT-autograd graphs (forward and backward) that inductor
    # would lower, with eager kernels: what compile changes in the step's semantics is covered.
    from services.models.nets.logprobs import compile_decoder

    # Micro-batches of equal shape: one graph with grad and one without, no recompilation.
    algo = AlgoSection(name="grpo", minibatch_size=6, micro_batch_size=3, kl_coef=0.1, kl_in="loss",
                       entropy_coef=0.01, lr=1e-2, logprob_chunk_tokens=3)
    steps = []
    for compiled in (False, True):
        model = _model(layers=2)
        if compiled:
            compile_decoder(model, backend="aot_eager")
        t = PolicyTrainer(model, algo, temperature=0.9)
        t.train_step(_rollout(), step=0, current_version=1)
        steps.append([p.detach().clone() for p in model.parameters()])
    _assert_same(*steps, tol=1e-5)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_compiled_token_logprobs_equal_the_eager_ones_with_their_gradients(entropy_grad: bool) -> None:
    # aot_eager: dynamo's capture and AOT autograd's forward and backward graphs, eager kernels (inductor's
    # C++ build takes minutes here); the fused kernels are what inductor then lowers these graphs to.
    from services.models.nets.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g)
    tokens = torch.randint(0, 50, (3, 5), generator=g)
    got = []
    for backend in (None, "aot_eager"):
        x = logits.clone().requires_grad_(True)
        lp, ent = token_logprobs(x, tokens, 0.9, with_entropy=True, entropy_grad=entropy_grad, backend=backend)
        assert ent.requires_grad is entropy_grad  # a statistic only: nothing kept for a backward
        (lp.sum() + (ent.sum() if entropy_grad else 0)).backward()
        got.append((lp.detach(), ent.detach(), x.grad))
    for eager, compiled in zip(*got, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)


def test_the_compile_flag_fuses_the_trainers_and_the_references_log_prob_steps() -> None:
    t = PolicyTrainer(_model(), AlgoSection(compile=True), temperature=1.0)
    ref = ReferenceScorer(_model(), temperature=1.0, compile=True)
    assert t.compile_backend == ref.compile_backend == "inductor"
    plain = PolicyTrainer(_model(), AlgoSection(), temperature=1.0)
    assert plain.compile_backend is None


def test_compile_is_on_unless_set_only_for_a_full_model_on_one_cuda_device() -> None:
    from services.models.nets.logprobs import wants_compile

    assert AlgoSection().compile is None
    assert wants_compile(None, "cuda:0") and wants_compile(None, torch.device("cuda", 1))
    assert not wants_compile(None, "cpu")  # Inductor's C++ builds cost more than a CPU run gains
    assert not wants_compile(None, "cuda:0", ranks=2)  # FSDP with compiled blocks: not measured
    assert not wants_compile(None, "cuda:0", adapters=True)  # LoRA: not measured
    assert wants_compile(True, "cpu") and not wants_compile(False, "cuda:0")
    assert PolicyTrainer(_model(), AlgoSection(), temperature=1.0).compile_backend is None  # this CPU
    assert ReferenceScorer(_model(), temperature=1.0, compile=None).compile_backend is None


class _CountingBackend:
    """aot_eager (dynamo's capture, AOT autograd's graphs, eager kernels) that counts the graphs it builds."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_compiler

        self.graphs += 1
        eager = make_boxed_compiler(lambda g, _: g)
        return aot_autograd(fw_compiler=eager, bw_compiler=eager)(gm, example_inputs)


# Past its recompile limit Dynamo runs a block eagerly, compiling nothing: an error in these tests instead.
@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
def test_the_warm_up_compiles_every_graph_the_first_steps_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.reference.scorer as scorer_mod
    import services.rl.trainer as trainer_mod

    torch._dynamo.reset()
    backend = _CountingBackend()
    monkeypatch.setattr(trainer_mod, "COMPILE_BACKEND", backend)
    monkeypatch.setattr(scorer_mod, "COMPILE_BACKEND", backend)
    # Minibatches of 3 rows in micro-batches of 2 and the remainder 1 (the weights move within the
    # batch, so the no-grad proximal forward runs too): other shapes than the warm-up's.
    algo = AlgoSection(name="grpo", minibatch_size=3, micro_batch_size=2, kl_coef=0.1, kl_in="loss",
                       entropy_coef=0.01, compile=True)
    t = PolicyTrainer(_model(), algo, temperature=0.9)
    ref = ReferenceScorer(_model(), temperature=0.9, micro_batch=4, compile=True)
    before = [p.detach().clone() for p in t.model.parameters()]
    assert t.warm_up(vocab=t.model.config.vocab_size, proximal=t.weights_move_within(6))
    assert ref.warm_up()
    assert backend.graphs > 0
    assert all(p.grad is None for p in t.model.parameters())  # no gradient left behind
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))  # no step taken
    assert not t.model.training
    built = backend.graphs
    ragged = _rollout()
    # Equal prompts, every response at full length: no padding at all, so no attention mask reaches
    # the decoder layers (a graph of its own), as in a synthetic benchmark's first steps.
    full = _rollout()
    full.prompt_mask = torch.ones_like(full.prompt_mask)
    full.response_mask = torch.ones_like(full.response_mask)
    for step, r in enumerate((full, ragged, full)):
        r.ref_logprobs = ref.score(r)
        stats = t.train_step(r, step=step, current_version=1)
        assert stats["compiles"] == 0, step
    assert backend.graphs == built  # the steps ran compiled code only


def test_a_compile_failure_in_the_warm_up_is_a_config_error_naming_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import services.reference.scorer as scorer_mod
    from services.core.config.run import ConfigError
    from services.models.nets.logprobs import warm_up_compiled

    def broken(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        raise RuntimeError("no C compiler for Triton's launcher")

    torch._dynamo.reset()
    monkeypatch.setattr(scorer_mod, "COMPILE_BACKEND", broken)
    ref = ReferenceScorer(_model(), temperature=0.9, compile=True)
    with pytest.raises(ConfigError, match=r"reference: torch.compile failed .*algo.compile: false"):
        warm_up_compiled("reference", ref.warm_up)
    with pytest.raises(ZeroDivisionError):  # anything else is not a compile failure: it propagates as is
        warm_up_compiled("reference", lambda: bool(1 / 0))
    assert not ReferenceScorer(_model(), temperature=0.9).warm_up()  # nothing to compile: nothing done


def test_a_step_that_compiles_says_so_in_its_row_and_its_log(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import services.rl.trainer as trainer_mod

    torch._dynamo.reset()
    monkeypatch.setattr(trainer_mod, "COMPILE_BACKEND", _CountingBackend())
    algo = AlgoSection(name="grpo", minibatch_size=6, micro_batch_size=6, compile=True)
    t = PolicyTrainer(_model(), algo, temperature=0.9)  # no warm-up: the first step compiles
    with caplog.at_level(logging.INFO, logger="services.models.nets.logprobs"):
        first = t.train_step(_rollout(), step=0, current_version=0)
    assert first["compiles"] > 0
    assert any(r.getMessage() == "compiled during a step" and r.__dict__["role"] == "actor" for r in caplog.records)
    assert t.train_step(_rollout(), step=1, current_version=0)["compiles"] == 0
    # Another batch size recompiles, and the log says which guard failed: what a warm-up missed.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="services.models.nets.logprobs"):
        other = t.train_step(ragged_rollout([0, 0, 0, 0], b=4), step=2, current_version=0)
    assert other["compiles"] > 0
    (rec,) = [r for r in caplog.records if r.getMessage() == "compiled during a step"]
    assert any("size" in why for why in rec.__dict__["guard_failures"]), rec.__dict__["guard_failures"]
    eager = PolicyTrainer(_model(), AlgoSection(name="grpo", minibatch_size=6, compile=False), temperature=0.9)
    assert "compiles" not in eager.train_step(_rollout(), step=0, current_version=0)


def test_a_recompile_of_an_earlier_compiled_function_is_the_guard_failure_a_step_reports(
        caplog: pytest.LogCaptureFixture) -> None:
    from services.models.nets.logprobs import CompileCount

    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def first(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @torch.compile(backend="eager")
    def second(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    first(torch.ones(3))
    first(torch.ones(3, 2))  # the earlier function's failure comes first in Dynamo's record
    second(torch.ones(3))
    second(torch.ones(3, dtype=torch.float64))  # then the later one's, before the count starts
    count = CompileCount()
    first(torch.ones(3, 2, 2))  # recompiles the earlier one: its list grows, not the last one
    with caplog.at_level(logging.INFO, logger="services.models.nets.logprobs"):
        assert count.since("actor") == 1
    (rec,) = [r for r in caplog.records if r.getMessage() == "compiled during a step"]
    why = rec.__dict__["guard_failures"]  # one per graph of `first` that the new input failed
    assert why and all("rank mismatch" in w and "actual 3" in w for w in why), why


class _SizeClassBackend(_CountingBackend):
    """The counting backend deciding, as Inductor's GPU fusion of mixed-order reductions does, by the
    size of each [rows, tokens, hidden] input: the comparison is a guard of the graph it builds."""

    def __init__(self, hidden: int, tokens: int) -> None:
        super().__init__()
        self.hidden, self.tokens = hidden, tokens

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        for node in gm.graph.find_nodes(op="placeholder"):
            v = node.meta.get("example_value")
            if isinstance(v, torch.Tensor) and v.dim() == 3 and v.size(2) == self.hidden:
                bool(v.size(0) * v.size(1) * v.size(2) >= self.tokens * self.hidden)
        return super().__call__(gm, example_inputs)


@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
def test_the_warm_up_builds_the_graphs_a_size_decided_fusion_needs_for_a_full_micro_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import services.rl.trainer as trainer_mod

    algo = AlgoSection(name="grpo", minibatch_size=8, micro_batch_size=8, compile=True)
    # 8 rows of 10 + 30 tokens: 320 tokens, past the threshold of 240 that every small warm-up rollout
    # stays under (the 1.5B step's 16 x 320 tokens at hidden 1536 against Inductor's 5 MiB elements).
    padded = ragged_rollout([0] * 8, b=8, p=10, r=30)
    padded.response_mask[0] = True
    unpadded = ragged_rollout([0] * 8, b=8, p=10, r=30)
    unpadded.prompt_mask = torch.ones_like(unpadded.prompt_mask)
    unpadded.response_mask = torch.ones_like(unpadded.response_mask)
    compiles = {}
    for full in (False, True):
        torch._dynamo.reset()
        monkeypatch.setattr(trainer_mod, "COMPILE_BACKEND", _SizeClassBackend(hidden=32, tokens=240))
        t = PolicyTrainer(_model(), algo, temperature=0.9)
        vocab = t.model.config.vocab_size
        assert t.warm_up(vocab, step_rows=8, response_tokens=30) if full else t.warm_up(vocab)
        compiles[full] = [t.train_step(r, step=s, current_version=0)["compiles"]
                          for s, r in enumerate((unpadded, padded))]
    assert all(compiles[False]), compiles  # small rollouts alone miss the full micro-batch's graphs
    assert compiles[True] == [0, 0], compiles


def test_the_full_size_warm_up_is_no_larger_than_a_real_micro_batch() -> None:
    from services.rl.warmup import full_prompt, full_size, warm_up_rollouts

    t = PolicyTrainer(_model(), AlgoSection(name="grpo", minibatch_size=64, micro_batch_size=16), temperature=1.0)
    assert t.micro_rows(256, 264) == 16 and t.micro_rows(8, 264) == 8
    assert PolicyTrainer(_model(), AlgoSection(minibatch_size=64), temperature=1.0).micro_rows(256, 264) == 64
    budget = PolicyTrainer(_model(), AlgoSection(minibatch_size=64, micro_batch_tokens=2048), temperature=1.0)
    assert budget.micro_rows(256, 264) == 7 and budget.micro_rows(256, 4096) == 1
    assert [full_prompt(n) for n in (256, 255, 1)] == [8, 9, 15]  # width a multiple of 8
    assert full_size(16, 256) == ((16, 8, 256, True), (16, 8, 256, False))
    assert full_size(0, 256) == () and full_size(16, 0) == ()
    small, full = warm_up_rollouts(97), warm_up_rollouts(97, (16, 256))
    assert len(full) == len(small) + 2
    assert [tuple(r.response_ids.shape) for r in full[-2:]] == [(16, 256), (16, 256)]
    assert full[-1].prompt_mask.all() and full[-1].response_mask.all() and not full[-2].response_mask.all()


def test_a_train_step_reads_its_statistics_back_once_per_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each read of a GPU value waits for the GPU; one per micro-batch drained the trainer's queue of
    # kernels while the engine's ran (py-spy, 0.5B on the H200). Minibatches of 3 rows in micro-batches
    # of 2 and 1: two optimizer steps, four micro-batches, one read each step.
    algo = AlgoSection(name="grpo", minibatch_size=3, micro_batch_size=2, kl_coef=0.1, kl_in="loss",
                       entropy_coef=0.01, lr=1e-2)
    t = PolicyTrainer(copy.deepcopy(_model()), algo, temperature=0.9)
    expected = copy.deepcopy(t).train_step(_rollout(), step=0, current_version=1)
    stats, reads = with_statistics_read_once(monkeypatch, lambda: t.train_step(_rollout(), step=0, current_version=1))
    keys = {"policy_loss", "kl_loss", "entropy", "clip_frac", "grad_norm"}
    assert len(reads) == 2 and all(keys <= set(r) for r in reads)
    assert stats == pytest.approx(expected, rel=1e-12)  # the same figures as reading each one at once


def test_tf32_is_on_for_a_cuda_trainer_unless_the_config_says_false_and_never_touches_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from services.models.nets import logprobs

    assert logprobs.wants_tf32(None, "cuda") and logprobs.wants_tf32(None, "cuda:1")
    assert not logprobs.wants_tf32(False, "cuda") and not logprobs.wants_tf32(None, "cpu")
    set_to: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", set_to.append)
    assert logprobs.use_tf32(None, "cuda") and set_to == ["high"]
    assert not logprobs.use_tf32(False, "cuda:0") and set_to == ["high", "highest"]
    # A CPU trainer, reference or critic leaves the process's matmul precision alone, whatever is set.
    t = PolicyTrainer(_model(), AlgoSection(tf32=True), temperature=1.0)
    ref = ReferenceScorer(_model(), temperature=1.0, tf32=True)
    assert not t.tf32 and not ref.tf32 and set_to == ["high", "highest"]
    assert AlgoSection().tf32 is None
    with pytest.raises(ValueError, match="tf32"):
        AlgoSection.model_validate({"tf32": "sometimes"})


def _grad_step(**levers: object) -> tuple[list[torch.Tensor], dict[str, float], PolicyTrainer]:
    """One train_step with SGD at lr 1: the update is the (clipped) gradient itself."""
    algo = AlgoSection(name="grpo", minibatch_size=6, micro_batch_size=4, entropy_coef=0.01, **levers)  # type: ignore[arg-type]
    t = PolicyTrainer(copy.deepcopy(_model()), algo, temperature=0.9)
    params = [p for p in t.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    t.opt = torch.optim.SGD(params, lr=1.0)
    stats = t.train_step(_rollout(), step=0, current_version=1)
    return [b - p.detach() for b, p in zip(before, params, strict=True)], stats, t


def test_a_bf16_autocast_step_follows_the_fp32_step_and_keeps_fp32_weights() -> None:
    full, full_stats, _ = _grad_step()
    mixed, stats, t = _grad_step(autocast="bfloat16")
    flat_full, flat_mixed = torch.cat([d.flatten() for d in full]), torch.cat([d.flatten() for d in mixed])
    cos = float(torch.nn.functional.cosine_similarity(flat_full, flat_mixed, dim=0))
    assert cos > 0.99, cos  # the same direction, to bf16's rounding of the matmuls
    assert not torch.equal(flat_full, flat_mixed)  # and the matmuls did run in bf16
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # weights and their updates stay fp32
    assert stats["policy_loss"] == pytest.approx(full_stats["policy_loss"], rel=0.05, abs=1e-3)
    with pytest.raises(ValueError, match="autocast"):
        AlgoSection.model_validate({"autocast": "float16"})  # fp16 would need loss scaling: not offered


def test_a_bf16_autocast_critic_gives_fp32_values_near_the_fp32_ones() -> None:
    from services.models.nets.critic import ValueModel
    from services.rl.trainer import ValueTrainer

    r = _rollout()
    torch.manual_seed(0)
    model = ValueModel(_model().model).eval()
    torch.nn.init.normal_(model.value_head.weight)  # a trained head: values that differ by state
    full = ValueTrainer(copy.deepcopy(model), AlgoSection()).score(r)
    mixed = ValueTrainer(copy.deepcopy(model), AlgoSection(autocast="bfloat16")).score(r)
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, full)
    torch.testing.assert_close(mixed, full, atol=0.05, rtol=0.05)
