"""Chunked log-probs (`chunk_tokens`): the numbers and gradients of the whole-vocabulary path, without its
`[B, R, V]` tensors."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.models.nets.logprobs import response_logprobs, split_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(vocab: int = 97, dtype: torch.dtype = torch.float32, **extra: Any) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=vocab, tie_word_embeddings=True, **extra)
    return Qwen2ForCausalLM(cfg).to(dtype)


def _batch(vocab: int = 97, b: int = 4, p: int = 5, r: int = 9) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    pm = torch.ones(b, p, dtype=torch.bool)
    pm[0, :2] = False  # left padding
    rm = torch.ones(b, r, dtype=torch.bool)
    rm[1, 4:] = False  # ragged responses, one of them empty
    rm[2, :] = False
    return (torch.randint(1, vocab, (b, p), generator=g), pm, torch.randint(1, vocab, (b, r), generator=g), rm)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_whole_vocabulary_path(chunk: int, temperature: float) -> None:
    model, batch = _model(), _batch()
    with torch.no_grad():
        lp, ent = response_logprobs(model, *batch, temperature=temperature, with_entropy=True)
        clp, cent = response_logprobs(model, *batch, temperature=temperature, with_entropy=True, chunk_tokens=chunk)
    torch.testing.assert_close(clp, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(cent, ent, atol=1e-5, rtol=0)
    assert torch.all(clp[~batch[3]] == 0) and torch.all(cent[~batch[3]] == 0)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_backward_gives_the_gradients_of_the_whole_vocabulary_path(entropy_grad: bool) -> None:
    batch = _batch()
    w = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(5))

    def grads(chunk: int) -> dict[str, torch.Tensor]:
        model = _model(dtype=torch.float64)
        lp, ent = response_logprobs(model, *batch, temperature=0.8, with_entropy=True, entropy_grad=entropy_grad,
                                    chunk_tokens=chunk)
        loss = (lp * w).sum() - 0.3 * ent.sum() if entropy_grad else (lp * w).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, chunked = grads(0), grads(4)
    assert whole.keys() == chunked.keys() and len(whole) > 10
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], atol=1e-9, rtol=1e-7, msg=name)


class _Scored(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.inner, self.batch = model, batch

    def forward(self) -> torch.Tensor:
        lp, ent = response_logprobs(self.inner, *self.batch, temperature=1.3, with_entropy=True, chunk_tokens=2)
        return torch.cat([lp.flatten(), ent.flatten()])


def test_chunked_head_passes_gradcheck() -> None:
    model = _model(vocab=11, dtype=torch.float64)
    scored = _Scored(model, _batch(vocab=11, b=3, p=2, r=3))
    head = model.get_output_embeddings().weight.detach().clone().requires_grad_(True)

    def f(weight: torch.Tensor) -> torch.Tensor:  # the tied head/embedding matrix as the input
        out: torch.Tensor = torch.func.functional_call(
            scored, {"inner.lm_head.weight": weight, "inner.model.embed_tokens.weight": weight}, ())
        return out

    # Log-probs come out in float32 whatever the weights: finite differences need a wide step.
    assert torch.autograd.gradcheck(f, (head,), eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=True)


def test_a_micro_batch_of_empty_responses_still_backpropagates() -> None:
    model = _model()
    pi, pm, ri, rm = _batch()
    lp, ent = response_logprobs(model, pi, pm, ri, torch.zeros_like(rm), with_entropy=True, chunk_tokens=4)
    assert torch.all(lp == 0) and torch.all(ent == 0)
    (lp.sum() + ent.sum()).backward()  # a zero loss, but a graph: the trainer's backward does not fail


def test_models_with_scaled_logits_use_the_whole_vocabulary_path() -> None:
    assert split_head(_model()) is not None
    assert split_head(_model(final_logit_softcapping=30.0)) is None
    model, batch = _model(final_logit_softcapping=30.0), _batch()
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, *batch, chunk_tokens=3), response_logprobs(model, *batch))


class _PeakBytes(TorchDispatchMode):
    """Bytes of tensor storage alive at once, counted at every op's outputs (the CPU has no allocator stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if key in self.seen or n == 0:
                continue
            self.seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._freed, key, n)
        return out

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)


def test_chunked_path_never_holds_the_batch_vocabulary_tensors() -> None:
    vocab, (b, r) = 8192, (4, 128)
    model, batch = _model(vocab=vocab), _batch(vocab=vocab, b=b, r=r)
    one_fp32_logits = b * r * vocab * 4

    def peak(chunk: int) -> int:
        model.zero_grad(set_to_none=True)
        with _PeakBytes() as pk:
            lp, ent = response_logprobs(model, *batch, with_entropy=True, chunk_tokens=chunk)
            (lp.sum() + ent.sum()).backward()
        return pk.peak

    whole, chunked = peak(0), peak(32)
    assert whole > 2 * one_fp32_logits
    # Gradients of the (tied) head and the chunk's own [32, V] tensors; nothing batch x vocabulary.
    assert chunked < one_fp32_logits, (chunked, whole)
