"""A LoRA run as a fleet (`rlfleet up` on examples/tiny-cpu-lora.yaml): it completes, the audit
passes, the actor checkpoints the adapters only, and both exports (the run's own merged one and
`rlfleet export --lora adapter`) score like the final checkpoint loaded as the actor restores it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.core.config.run import load_config
from services.models.checkpoints.checkpoint import load_checkpoint
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import response_logprobs
from services.models.nets.lora import is_lora, load_policy
from services.report import read_metrics
from tests.e2e.test_export import _inputs

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu-lora.yaml"
STEPS = 3


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _logprobs(model, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return response_logprobs(model, *inputs)


def test_a_lora_fleet_run_audits_and_exports_what_it_trained(tiny_model: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["models"]["policy"] = {"path": str(tiny_model), "lora": data["models"]["policy"]["lora"]}
    data["run"].update(eval_every=0)
    data["task"]["eval_size"] = 8  # held-out generation goes through the engine's merged weights too
    data["batch"] = {"prompts_per_step": 8, "prompts_per_message": 4}
    cfg_file = tmp_path / "lora.yaml"
    cfg_file.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"

    up = _cli("up", "--config", str(cfg_file), "--max-steps", str(STEPS), "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stderr[-2000:]
    assert _cli("audit", "--run-dir", str(run_dir), "--finished", timeout=120).returncode == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["kl_loss"] >= 0 for r in rows[1:])  # the reference (the base) scored every step

    checkpoint = run_dir / "checkpoints" / "actor" / f"v{STEPS:08d}"
    assert (checkpoint.parent / "latest").read_text().strip() == checkpoint.name
    assert all("lora_" in k for k in load_file(str(checkpoint / "model.safetensors")))  # adapters only

    # The trainer as a restarted actor rebuilds it: base + fresh adapters, then the checkpoint.
    spec = load_config(run_dir / "fleet.yaml").models.policy
    trainer = load_policy(spec, tiny_model, "cpu", seed=123)
    assert is_lora(trainer)
    load_checkpoint(checkpoint, trainer, service="actor")
    inputs = _inputs(load_tokenizer(tiny_model))
    m = inputs[3]
    want = _logprobs(trainer, inputs)
    assert (_logprobs(load_causal_lm(tiny_model), inputs)[m] - want[m]).abs().max() > 1e-4  # it trained

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()  # the run's own export
    assert torch.allclose(_logprobs(merged, inputs)[m], want[m], atol=1e-5, rtol=0)

    out = tmp_path / "adapter"
    done = _cli("export", "--run-dir", str(run_dir), "--out", str(out), "--lora", "adapter", timeout=300)
    assert done.returncode == 0, done.stderr
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out).eval()
    assert torch.allclose(_logprobs(adapted, inputs)[m], want[m], atol=1e-6, rtol=0)
