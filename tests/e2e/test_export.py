"""`rlfleet export` after a real `rlfleet train --local`: the exported directory loads with plain
`from_pretrained` and scores exactly like the trainer's checkpoint; bad input is one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.cli import main
from services.models.checkpoints.checkpoint import load_checkpoint
from services.models.io.loading import load_causal_lm, load_tokenizer
from services.models.nets.logprobs import response_logprobs
from services.tasks import make_task
from tests.fleet_helpers import EXAMPLE, tiny_config

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def trained_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished local run of a few steps, through the real CLI, checkpointing versions 2 and 3."""
    root = tmp_path_factory.mktemp("export")
    data = yaml.safe_load(EXAMPLE.read_text())
    data["models"]["policy"] = {"path": str(tiny_model)}
    data["run"].update(eval_every=0)
    data["task"]["eval_size"] = 8
    data["batch"] = {"prompts_per_step": 8, "prompts_per_message": 4}
    data["algo"].update(minibatch_size=32, ppo_epochs=1, lr=1e-3)
    data["checkpoint"] = {"every": 2, "keep": 3}
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = root / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", "--local", "--config", str(cfg), "--max-steps", str(STEPS),
         "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def _inputs(tokenizer, n: int = 6) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    """Left-padded prompts and right-padded responses, as rollouts carry them."""
    task = make_task("arithmetic", {"max_operand": 20, "ops": "+"})
    prompts = [list(tokenizer(task.prompt(i).text, add_special_tokens=False)["input_ids"]) for i in range(n)]
    answers = [list(tokenizer(str(i * 3 % 40), add_special_tokens=False)["input_ids"])[: 1 + i % 3] for i in range(n)]
    pw, rw = max(map(len, prompts)), max(map(len, answers))
    pad = int(tokenizer.pad_token_id)
    pi = torch.tensor([[pad] * (pw - len(p)) + p for p in prompts])
    pm = torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in prompts]).bool()
    ri = torch.tensor([a + [pad] * (rw - len(a)) for a in answers])
    rm = torch.tensor([[1] * len(a) + [0] * (rw - len(a)) for a in answers]).bool()
    return pi, pm, ri, rm


def _logprobs(model, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return response_logprobs(model, *inputs)


def _trainer_model(base: Path, checkpoint: Path):  # type: ignore[no-untyped-def]
    """The policy exactly as the actor restores it: the base model, then the checkpoint in place."""
    model = load_causal_lm(base)
    load_checkpoint(checkpoint, model, service="actor")
    return model


def test_export_scores_exactly_like_the_trainers_checkpoint(trained_run: Path, tiny_model: Path,
                                                            tmp_path: Path) -> None:
    ckpts = trained_run / "checkpoints" / "actor"
    assert (ckpts / "latest").read_text().strip() == f"v{STEPS:08d}"
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "export", "--run-dir", str(trained_run),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"exported actor version {STEPS} (step {STEPS}) of {trained_run} to {out}"

    # Plain transformers, nothing of ours: the directory is self-contained.
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(tiny_model)
    assert tok.get_vocab() == ours.get_vocab() and tok.eos_token == ours.eos_token
    assert json.loads((out / "rlfleet_export.json").read_text())["version"] == STEPS

    inputs = _inputs(ours)
    want = _logprobs(_trainer_model(tiny_model, ckpts / f"v{STEPS:08d}"), inputs)
    got = _logprobs(exported, inputs)
    m = inputs[3]
    assert torch.allclose(got[m], want[m], atol=1e-6, rtol=0)
    # Training moved the weights, so matching the checkpoint is not matching the base model.
    base = _logprobs(load_causal_lm(tiny_model), inputs)
    assert (base[m] - want[m]).abs().max() > 1e-4

    # An earlier version on request; and the run's own end-of-run export is its last version.
    v2 = tmp_path / "v2"
    assert main(["export", "--run-dir", str(trained_run), "--version", "2", "--out", str(v2)]) == 0
    got2 = _logprobs(AutoModelForCausalLM.from_pretrained(v2).eval(), inputs)
    assert torch.allclose(got2[m], _logprobs(_trainer_model(tiny_model, ckpts / "v00000002"), inputs)[m], atol=1e-6)
    assert (got2[m] - got[m]).abs().max() > 1e-6
    final = _logprobs(AutoModelForCausalLM.from_pretrained(trained_run / "export").eval(), inputs)
    assert torch.allclose(final[m], want[m], atol=1e-6, rtol=0)


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_export_bad_input_is_one_line_naming_it(trained_run: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    assert f"run directory {missing} does not exist" in _fails(
        ["export", "--run-dir", str(missing), "--out", str(tmp_path / "a")], capsys)

    untrained = tmp_path / "untrained"
    (untrained / "models").mkdir(parents=True)
    err = _fails(["export", "--run-dir", str(untrained), "--out", str(tmp_path / "b")], capsys)
    assert f"no actor checkpoint in {untrained / 'checkpoints' / 'actor'}" in err

    err = _fails(["export", "--run-dir", str(trained_run), "--version", "7", "--out", str(tmp_path / "c")], capsys)
    assert "no actor checkpoint of version 7" in err and "versions there: 2, 3" in err

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    err = _fails(["export", "--run-dir", str(trained_run), "--out", str(busy)], capsys)
    assert f"--out {busy} already exists and is not an empty directory" in err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_export_of_a_fleet_run_finds_its_model_through_fleet_yaml(tiny_model: Path, tmp_path: Path,
                                                                 fleet_factory) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config(tmp_path / "fleet", tiny_model, run={"max_steps": 2, "eval_every": 0}, task={"eval_size": 0},
                      batch={"prompts_per_step": 8, "prompts_per_message": 4})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    assert fleet.supervise(timeout_s=300) == 0
    fleet.stop(grace_s=60)  # the actor checkpoints its last version when drained
    out = tmp_path / "exported"
    assert main(["export", "--run-dir", str(cfg.run_dir), "--out", str(out)]) == 0
    checkpoint = cfg.run_dir / "checkpoints" / "actor" / "v00000002"
    assert checkpoint.is_dir()
    inputs = _inputs(load_tokenizer(tiny_model))
    m = inputs[3]
    got = _logprobs(AutoModelForCausalLM.from_pretrained(out).eval(), inputs)
    want = _logprobs(_trainer_model(tiny_model, checkpoint), inputs)
    assert torch.allclose(got[m], want[m], atol=1e-6, rtol=0)
