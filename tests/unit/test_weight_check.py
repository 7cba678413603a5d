"""The checksums of a weight sync (`weights.check`): exact and layout-blind (a fused parameter's sums
are its parts', however the reduction is chunked), one ulp anywhere shows, the trainer's reference is
cast like the engine casts, and a mismatch names the parameter and both values. vLLM's layout is
built here from real tensors the way its loader fuses them (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from services.models.engines.vllm_adapter import held_in_trainer_names
from services.models.weights import check as weight_check
from services.models.weights.check import Held, WeightsMismatch, held_by_state, sums_of, unfuse, verify


def _one_ulp(t: torch.Tensor, at: int) -> torch.Tensor:
    out = t.clone()
    out.reshape(-1)[at : at + 1].view(torch.int16)[0] ^= 1  # the lowest word of one element
    return out


def test_a_fused_parameters_sums_are_its_parts_sums_whatever_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g).to(torch.bfloat16) for n in (8, 2, 2))
    parts = sums_of([q, k, v])
    fused = sums_of([torch.cat([q, k, v])])[0]
    assert fused == (sum(p[0] for p in parts), sum(p[1] for p in parts))
    monkeypatch.setattr(weight_check, "CHUNK", 5)  # many chunks: integer sums do not depend on the order
    assert sums_of([torch.cat([q, k, v])])[0] == fused
    padded = torch.cat([q, torch.zeros(3, 8, dtype=torch.bfloat16)])  # vLLM's zero vocabulary padding
    assert sums_of([padded])[0] == parts[0]
    for dtype in (torch.bfloat16, torch.float32, torch.int64, torch.bool):
        t = torch.randn(64, generator=g).to(dtype)
        if dtype is not torch.bool:
            assert sums_of([_one_ulp(t, 37)])[0] != sums_of([t])[0], dtype


def test_the_reference_is_cast_like_the_engine_casts_and_a_mismatch_names_parameter_and_values() -> None:
    g = torch.Generator().manual_seed(1)
    sent = {"a.weight": torch.randn(4, 4, generator=g), "b.weight": torch.randn(4, generator=g)}
    engine = {n: t.to(torch.bfloat16) for n, t in sent.items()}  # what a bf16 engine does with fp32 weights
    verdict = verify(held_by_state(engine, [["a.weight"], ["b.weight"]]), sent, 3)
    assert (verdict.checked, verdict.unsent, verdict.unheld) == (2, (), ())

    engine["b.weight"] = _one_ulp(engine["b.weight"], 2)
    held = held_by_state(engine, [["a.weight"], ["b.weight"]])
    with pytest.raises(WeightsMismatch, match=r"version 3 .*engine-replica1 holds b\.weight with checksum") as err:
        verify(held, sent, 3, who="engine-replica1")
    assert err.value.parameter == "b.weight" and err.value.held == held[1].sums
    assert err.value.sent == sums_of([sent["b.weight"].to(torch.bfloat16)])[0] != err.value.held
    assert f"{err.value.held}" in str(err.value) and f"{err.value.sent}" in str(err.value)


def test_vllms_fused_and_tied_parameters_are_checked_against_the_trainers_tensors() -> None:
    g = torch.Generator().manual_seed(2)
    p = "model.layers.0."
    trainer = {f"{p}self_attn.{x}_proj.weight": torch.randn(n, 8, generator=g)
               for x, n in (("q", 8), ("k", 2), ("v", 2), ("o", 8))}
    trainer |= {f"{p}mlp.{x}_proj.weight": torch.randn(16, 8, generator=g) for x in ("gate", "up")}
    trainer["model.embed_tokens.weight"] = trainer["lm_head.weight"] = torch.randn(32, 8, generator=g)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert unfuse(f"{p}self_attn.qkv_proj.weight", packed) == tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")
    bf = {n: t.to(torch.bfloat16) for n, t in trainer.items()}
    vllm = {  # vLLM's parameters: fused along the output dim, the tied head listed once
        f"{p}self_attn.qkv_proj.weight": torch.cat([bf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]),
        f"{p}self_attn.o_proj.weight": bf[f"{p}self_attn.o_proj.weight"],
        f"{p}mlp.gate_up_proj.weight": torch.cat([bf[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]),
        "model.embed_tokens.weight": bf["model.embed_tokens.weight"],
    }
    groups = [[n] for n in trainer if "embed" not in n and "lm_head" not in n]
    groups.append(["model.embed_tokens.weight", "lm_head.weight"])

    def rows(model: dict[str, torch.Tensor]) -> list[tuple[str, str, int, int]]:
        return [(n, "bfloat16", *s) for n, s in zip(model, sums_of(list(model.values())), strict=True)]

    held = held_in_trainer_names(rows(vllm), packed, groups)
    assert held[0].parts == tuple((f"{p}self_attn.{x}_proj.weight",) for x in "qkv")
    verdict = verify(held, trainer, 1)
    assert (verdict.checked, verdict.unsent, verdict.unheld) == (4, (), ())

    vllm[f"{p}mlp.gate_up_proj.weight"] = _one_ulp(vllm[f"{p}mlp.gate_up_proj.weight"], 200)  # in up_proj's half
    with pytest.raises(WeightsMismatch, match=r"gate_up_proj\.weight \(made of .*gate_proj\.weight \+ .*up_proj"):
        verify(held_in_trainer_names(rows(vllm), packed, groups), trainer, 2)


def test_unpaired_tensors_are_counted_not_compared() -> None:
    held = [Held("x.weight", "float32", (0, 0), (("x.weight",),)), Held("extra", "float32", (1, 1), (("nope",),))]
    verdict = verify(held, {"x.weight": torch.zeros(3), "y.weight": torch.zeros(2)}, 1)
    assert (verdict.checked, verdict.unsent, verdict.unheld) == (1, ("extra",), ("y.weight",))
