"""The workload both frameworks run: the two model shapes, the GRPO hyper-parameters (`W`, shrunk by a
dry run), the random-weight model and the synthetic prompts; the harness's paths and progress line."""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

from bench import common

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/rlfleet-vs-trl"))
DRY = os.environ.get("BENCH_DRY") == "1"

_COMMON: dict[str, Any] = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                               tie_word_embeddings=True)
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, **_COMMON),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, **_COMMON),
}
W: dict[str, Any] = dict(prompts_per_step=32, group=8, prompt_tokens=64, completion_tokens=256, micro_batch=16,
                         kl_coef=0.04, lr=1e-6, steps=5, warmup=2)
if DRY:
    for shape in SHAPES.values():
        shape.update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, vocab_size=260)
    W.update(prompts_per_step=2, group=2, prompt_tokens=4, completion_tokens=4, micro_batch=2, steps=2, warmup=1)
N_SPECIAL = 4  # <pad> <s> </s> <unk> of the word-level tokenizer


say = partial(common.say, tag="vs_trl")


def model_dir(workload: str) -> Path:
    return WORK / ("model-dry" if DRY else f"model-{workload}")  # a dry run has one tiny shape


def build_model(workload: str) -> Path:
    """Random-weight Qwen2 in bf16 plus a word tokenizer whose vocabulary is the model's (every id decodes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.models.roles.tokenizer import build_tokenizer_from_vocab

    path = model_dir(workload)
    if (path / "config.json").exists():
        return path
    shape = SHAPES[workload]
    tok = build_tokenizer_from_vocab(synthetic_task(workload).vocab(), "word")
    cfg = Qwen2Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the phases' processes want this memory, and NVML counts it as used
    return path


def synthetic_task(workload: str = "0.5b") -> Any:
    from services.tasks.synthetic import SyntheticTask

    return SyntheticTask({"prompt_tokens": W["prompt_tokens"], "completion_tokens": W["completion_tokens"],
                          "words": SHAPES[workload]["vocab_size"] - N_SPECIAL})
