"""The README's "Bring your own model and data" run, exactly as shown: examples/byo/ (a JSONL file,
a file of batched rewards, a local model directory written with save_pretrained) trains as a fleet
through `rlfleet up`, logs each reward component, exports a model that scores like its checkpoint,
and passes the audit."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.core.journal.journal import Journal
from services.models.io.loading import load_tokenizer
from services.report import read_metrics
from tests.byo_helpers import (
    RLFLEET,
    check_audit,
    check_export_matches_checkpoint,
    check_journaled_prompt,
    exported,
    rlfleet_up,
    write_config,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_readme_byo_run_trains_on_a_jsonl_with_reward_file_and_local_model_and_exports(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "byo", tmp_path / "examples" / "byo")
    made = subprocess.run([sys.executable, "examples/byo/make_model.py", "runs/byo-model"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    model = tmp_path / "runs" / "byo-model"
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()

    run_dir = tmp_path / "runs" / "byo"
    rlfleet_up(Path("examples/byo/config.yaml"), Path("runs/byo"), 2, cwd=tmp_path, timeout_s=840)

    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # Each component's mean, and the total is their weighted sum (weights 1.0 and 0.1 in the config).
        assert 0.0 <= m["reward/correct"] <= 1.0 and 0.0 <= m["reward/brevity"] <= 1.0
        assert math.isclose(m["reward_mean"], m["reward/correct"] + 0.1 * m["reward/brevity"], abs_tol=1e-5)
    check_journaled_prompt(run_dir)

    tok = load_tokenizer(model)
    prompt = list(tok("3+4=", add_special_tokens=False)["input_ids"])
    response = [*tok("7", add_special_tokens=False)["input_ids"], int(tok.eos_token_id)]
    check_export_matches_checkpoint(run_dir, model, prompt, response)
    assert (exported(run_dir) / "tokenizer.json").is_file()
    check_audit(run_dir)


FAILING_TEMPLATE = ("{% if 'bad' in messages[-1]['content'] %}{{ raise_exception('no bad rows') }}{% endif %}"
                    "{{ messages[-1]['content'] }}")


@pytest.mark.timeout(900)
def test_a_row_whose_chat_template_fails_ends_dead_with_the_reason_and_the_run_goes_on(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "byo", tmp_path / "examples" / "byo")
    made = subprocess.run([sys.executable, "examples/byo/make_model.py", "runs/byo-model"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    tok = load_tokenizer(tmp_path / "runs" / "byo-model")
    tok.chat_template = FAILING_TEMPLATE
    tok.save_pretrained(tmp_path / "runs" / "byo-model")
    good = (tmp_path / "examples" / "byo" / "problems.jsonl").read_text().splitlines()
    rows = []
    for i, line in enumerate(good):
        if i % 5 == 0:  # every fifth row breaks the template; the held-out slice cannot hold them all
            rows.append(json.dumps({"question": "bad", "answer": "0", "level": "easy"}))
        rows.append(line)
    data = tmp_path / "examples" / "byo" / "mixed.jsonl"
    data.write_text("\n".join(rows) + "\n")
    cfg = write_config(tmp_path / "examples" / "byo" / "config.yaml", tmp_path / "mixed.yaml",
                       task={"path": "examples/byo/mixed.jsonl", "shuffle": False})
    run_dir = tmp_path / "runs" / "mixed"
    rlfleet_up(cfg, run_dir, 2, cwd=tmp_path, timeout_s=840)

    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    with Journal.open(run_dir / "journal", readonly=True) as j:
        tasks = list(j.iter_tasks())
    dead = [t for t in tasks if t.state == "dead"]
    assert dead, "a bad row was admitted"
    for t in dead:
        assert (t.reason or "").startswith("bad_prompt: "), t.reason
        assert "mixed.jsonl" in (t.reason or "") and "the chat template failed" in (t.reason or ""), t.reason
    assert sum(t.state == "trained" for t in tasks) == 2 * 4 * 4  # steps x prompts_per_step x group_size
    check_audit(run_dir)


@pytest.mark.timeout(600)
def test_local_loop_logs_each_reward_component_like_the_fleet(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples" / "byo", tmp_path / "examples" / "byo")
    made = subprocess.run([sys.executable, "examples/byo/make_model.py", "runs/byo-model"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    p = subprocess.run([*RLFLEET, "train", "--local", "--config", "examples/byo/config.yaml", "--max-steps", "2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    metrics = read_metrics(tmp_path / "runs" / "byo" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isclose(m["reward_mean"], m["reward/correct"] + 0.1 * m["reward/brevity"], abs_tol=1e-5)
