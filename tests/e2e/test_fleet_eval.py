"""Held-out evaluation in a real fleet (`rlfleet up`) against the single-process loop (`rlfleet train
--local`) on the same config and seed: the same eval numbers at the same steps, the same completions
in samples.jsonl, a report with the audit's verdict and the samples, and a final export that
`from_pretrained` loads."""

from __future__ import annotations

import html
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.models.checkpoints.checkpoint import load_checkpoint
from services.models.io.loading import load_causal_lm
from services.report import read_metrics
from services.tasks.evaluation import read_samples
from tests.fleet_helpers import EXAMPLE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, EVAL_SIZE = 4, 2, 16
EVAL_KEYS = ("eval_reward", "eval_reward_greedy", "eval_accuracy", "eval_accuracy_greedy")


def _config(path: Path, run_dir: Path, model: Path) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"].update(dir=str(run_dir), max_steps=STEPS, eval_every=EVERY)
    data["task"]["eval_size"] = EVAL_SIZE
    data["models"]["policy"] = {"path": str(model)}
    data["services"] = {n: {"grpc_port": 0, "http_port": 0}
                        for n in ("controller", "actor", "critic", "reward", "reference")}
    path.write_text(yaml.safe_dump(data))
    return path


def _rlfleet(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet-eval")
    out = {}
    for kind, cmd in (("local", ["train", "--local"]), ("fleet", ["up"])):
        run_dir = root / kind
        p = _rlfleet(*cmd, "--config", str(_config(root / f"{kind}.yaml", run_dir, tiny_model)))
        assert p.returncode == 0, (kind, p.stdout[-2000:], p.stderr[-3000:])
        out[kind] = run_dir
    return out


def _by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(r["step"]): r for r in read_metrics(run_dir / "metrics.jsonl")}


def test_fleet_eval_rows_equal_the_local_loops_at_the_same_steps(runs: dict[str, Path]) -> None:
    local, fleet = _by_step(runs["local"]), _by_step(runs["fleet"])
    assert sorted(fleet) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        evaluated = step % EVERY == 0 or step == STEPS
        for key in EVAL_KEYS:
            assert (key in fleet[step]) == evaluated, (step, key)
            assert (key in local[step]) == evaluated, (step, key)
            if evaluated:
                assert fleet[step][key] == pytest.approx(local[step][key], abs=1e-6), (step, key)
    for key in EVAL_KEYS:  # the evaluation before training rides on step 1's row, as locally
        assert fleet[1][f"{key}_before"] == pytest.approx(local[1][f"{key}_before"], abs=1e-6), key
    for row in fleet.values():
        assert 0.0 <= row.get("eval_accuracy", 0.0) <= 1.0


def test_samples_jsonl_holds_every_eval_completion_and_matches_the_local_loop(runs: dict[str, Path]) -> None:
    fleet, local = read_samples(runs["fleet"] / "samples.jsonl"), read_samples(runs["local"] / "samples.jsonl")
    evals = [0, *range(EVERY, STEPS + 1, EVERY)]
    assert len(fleet) == len(evals) * 2 * EVAL_SIZE
    keyed = {(s["step"], s["mode"], s["index"]): s for s in fleet}
    assert sorted({k[0] for k in keyed}) == evals and {k[1] for k in keyed} == {"greedy", "sampled"}
    for s in local:
        f = keyed[(s["step"], s["mode"], s["index"])]
        assert (f["version"], f["prompt"], f["completion"], f["answer"]) == (
            s["version"], s["prompt"], s["completion"], s["answer"])
        assert f["reward"] == pytest.approx(s["reward"], abs=1e-6)
    # Each step's mean over its samples is that step's metric.
    rows = _by_step(runs["fleet"])
    greedy4 = [s["reward"] for s in fleet if s["step"] == STEPS and s["mode"] == "greedy"]
    assert sum(greedy4) / len(greedy4) == pytest.approx(rows[STEPS]["eval_reward_greedy"], abs=1e-6)


def test_report_shows_the_audit_verdict_the_samples_and_the_config(runs: dict[str, Path]) -> None:
    doc = (runs["fleet"] / "report.html").read_text()
    assert "audit: <b>PASS</b>" in doc
    for name in ("no loss", "exactly-once effect", "bounded staleness", "monotonic versions", "bounded resources"):
        assert f"<td>{name}</td><td>PASS</td>" in doc, name
    assert '<table class="samples">' in doc
    first = read_samples(runs["fleet"] / "samples.jsonl")[0]
    assert f"<td>{html.escape(first['prompt'])}</td>" in doc
    assert "Config (fleet.yaml)" in doc and f"eval_every: {EVERY}" in doc
    assert "wall time" in doc and 'alt="Held-out evaluation"' in doc


def test_the_final_export_loads_with_from_pretrained_and_holds_the_last_version(runs: dict[str, Path],
                                                                                tiny_model: Path) -> None:
    export = runs["fleet"] / "export"
    model = AutoModelForCausalLM.from_pretrained(export)
    AutoTokenizer.from_pretrained(export)
    trained = load_causal_lm(tiny_model)
    load_checkpoint(runs["fleet"] / "checkpoints" / "actor" / f"v{STEPS:08d}", trained, service="actor")
    got, want = model.state_dict(), trained.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name].to(t.dtype), t), name
