from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from services.core.config.run import TinyModelSpec
from services.models.io.loading import load_causal_lm
from services.models.nets.logprobs import position_ids_from_mask, response_logprobs
from services.models.roles.tiny import build_tiny_model
from services.tasks import make_task

SPEC = TinyModelSpec(warmup_steps=10)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedModel:
    path = build_tiny_model(make_task("arithmetic"), SPEC, tmp_path_factory.mktemp("m") / "policy", seed=1)
    return load_causal_lm(path)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _batch(rows: list[tuple[list[int], list[int]]], pad: int = 0) -> Batch:
    p = max(len(a) for a, _ in rows)
    r = max(len(b) for _, b in rows)
    pi = torch.full((len(rows), p), pad)
    pm = torch.zeros((len(rows), p), dtype=torch.bool)
    ri = torch.full((len(rows), r), pad)
    rm = torch.zeros((len(rows), r), dtype=torch.bool)
    for i, (a, b) in enumerate(rows):
        pi[i, p - len(a):] = torch.tensor(a)
        pm[i, p - len(a):] = True
        ri[i, : len(b)] = torch.tensor(b)
        rm[i, : len(b)] = True
    return pi, pm, ri, rm


ROWS = [([5, 6, 14, 11, 16], [5, 7, 2]), ([7, 16], [4, 4, 4, 4, 2]), ([5, 5, 5, 14, 5, 5, 5, 16], [9])]


def test_position_ids_count_real_tokens_from_zero() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]


def test_row_alone_equals_row_padded_in_a_batch(model: PreTrainedModel) -> None:
    batch = response_logprobs(model, *_batch(ROWS))
    for i, row in enumerate(ROWS):
        alone = response_logprobs(model, *_batch([row]))
        n = len(row[1])
        torch.testing.assert_close(batch[i, :n], alone[0, :n], atol=1e-5, rtol=0)


def test_matches_a_naive_full_softmax_over_the_unpadded_sequence(model: PreTrainedModel) -> None:
    temperature = 0.7
    out = response_logprobs(model, *_batch(ROWS), temperature=temperature)
    for i, (prompt, resp) in enumerate(ROWS):
        ids = torch.tensor([prompt + resp])
        logits = model(input_ids=ids).logits[0].float() / temperature
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(resp)[:, None])
        torch.testing.assert_close(out[i, : len(resp)], expected.squeeze(-1), atol=1e-5, rtol=0)


def test_padding_positions_are_zero_and_shape_is_b_by_r(model: PreTrainedModel) -> None:
    pi, pm, ri, rm = _batch(ROWS)
    lp, ent = response_logprobs(model, pi, pm, ri, rm, with_entropy=True)
    assert lp.shape == ri.shape == ent.shape and lp.dtype == torch.float32
    assert torch.all(lp[~rm] == 0) and torch.all(ent[~rm] == 0)
    assert torch.all(lp[rm] < 0) and torch.all(ent[rm] > 0)


def test_entropy_is_the_entropy_of_the_tempered_distribution(model: PreTrainedModel) -> None:
    prompt, resp = ROWS[0]
    _, ent = response_logprobs(model, *_batch([ROWS[0]]), temperature=2.0, with_entropy=True)
    logits = model(input_ids=torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1].float() / 2.0
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent[0], -(p * p.log()).sum(-1), atol=1e-5, rtol=0)


def test_gradients_flow_to_the_weights(model: PreTrainedModel) -> None:
    model.zero_grad()
    lp = response_logprobs(model, *_batch(ROWS))
    lp.sum().backward()
    m: Any = model
    grad = m.get_input_embeddings().weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad()


def test_bad_temperature_and_shapes_are_rejected(model: PreTrainedModel) -> None:
    pi, pm, ri, rm = _batch(ROWS)
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(model, pi, pm, ri, rm, temperature=0.0)
    with pytest.raises(ValueError, match="shapes disagree"):
        response_logprobs(model, pi, pm[:, 1:], ri, rm)


def test_empty_response_gives_an_empty_result(model: PreTrainedModel, tmp_path: Path) -> None:
    pi, pm, _, _ = _batch(ROWS)
    out = response_logprobs(model, pi, pm, torch.zeros((3, 0), dtype=torch.long), torch.zeros((3, 0), dtype=torch.bool))
    assert out.shape == (3, 0)
