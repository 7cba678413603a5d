"""Held-out evaluation's shared half: when a task has a notion of correct, the metrics keys it
records, the samples lines, and the report's audit and samples sections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.core.config.run import TaskSection
from services.report import SAMPLES_PER_EVAL, write_report
from services.tasks import evaluation as ev
from services.tasks import load_task


def _write_reward(tmp_path: Path) -> str:
    (tmp_path / "r.py").write_text("def score(prompt, completion):\n    return 0.5\n")
    return str(tmp_path / "r.py")


def test_arithmetic_and_math_verify_rewards_are_binary_so_the_task_knows_correct(tmp_path: Path) -> None:
    assert load_task(TaskSection(name="arithmetic")).correct_at == 1.0
    assert load_task(TaskSection(name="arithmetic", rewards=[{"fn": "task"}])).correct_at == 1.0
    assert load_task(TaskSection(name="arithmetic", rewards=[{"fn": "math_verify"}])).correct_at == 1.0
    assert load_task(TaskSection(name="sentiment")).correct_at is None


def test_a_user_reward_or_a_weighted_mix_has_no_notion_of_correct(tmp_path: Path) -> None:
    path = _write_reward(tmp_path)
    assert load_task(TaskSection(name="arithmetic", reward_path=f"{path}:score")).correct_at is None
    mix = [{"fn": "task"}, {"fn": "math_verify", "weight": 0.5}]
    assert load_task(TaskSection(name="arithmetic", rewards=mix)).correct_at is None
    assert load_task(TaskSection(name="arithmetic", rewards=[{"fn": "task", "weight": 2.0}])).correct_at is None


def test_metrics_keys_per_mode_with_accuracy_only_where_correct_is_known() -> None:
    task = load_task(TaskSection(name="arithmetic"))
    prompts = ev.eval_prompts(task, 4)
    right = [p.answer for p in prompts]
    wrong = ["x"] * 4
    half = right[:2] + wrong[:2]
    res = {"greedy": ev.evaluate_mode(task, "greedy", prompts, right, reward_model=False),
           "sampled": ev.evaluate_mode(task, "sampled", prompts, half, reward_model=False)}
    assert ev.metrics_of(res) == {"eval_reward_greedy": 1.0, "eval_accuracy_greedy": 1.0,
                                  "eval_reward": 0.5, "eval_accuracy": 0.5}
    assert set(ev.metrics_of(res, "_before")) == {"eval_reward_greedy_before", "eval_accuracy_greedy_before",
                                                 "eval_reward_before", "eval_accuracy_before"}
    unavailable = {"sampled": ev.evaluate_mode(task, "sampled", prompts, half, reward_model=True)}
    assert ev.metrics_of(unavailable) == {}
    lines = [json.loads(x) for x in ev.sample_lines(3, 3, prompts, unavailable)]
    assert [x["reward"] for x in lines] == [None] * 4 and lines[0]["answer"] == prompts[0].answer


def test_eval_size_is_capped_by_the_held_out_prompts_a_task_has() -> None:
    task = load_task(TaskSection(name="arithmetic"))
    assert ev.eval_size(task, 16) == 16
    task.eval_count = 5
    assert ev.eval_size(task, 16) == 5


def test_report_of_a_local_run_shows_samples_per_eval_and_says_there_is_no_journal(tmp_path: Path) -> None:
    task = load_task(TaskSection(name="arithmetic"))
    prompts = ev.eval_prompts(task, SAMPLES_PER_EVAL + 3)
    with (tmp_path / "samples.jsonl").open("w") as f:
        for step in (0, 2):
            res = {m: ev.evaluate_mode(task, m, prompts, [f"<{step}:{m}:{p.index}>" for p in prompts],
                                       reward_model=False) for m in ev.MODES}
            f.writelines(ev.sample_lines(step, step, prompts, res))
    (tmp_path / "local.yaml").write_text("run:\n  eval_every: 2\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1e10, "reward_mean": 0.1,
                                                        "eval_reward_before": 0.2}) + "\n")
    doc = write_report(tmp_path).read_text()
    assert "audit: not applicable" in doc
    for step in (0, 2):
        for m in ev.MODES:
            shown = [i for i in range(len(prompts)) if f"&lt;{step}:{m}:{i}&gt;" in doc]
            assert shown == list(range(SAMPLES_PER_EVAL)), (step, m)
    assert "Config (local.yaml)" in doc and "eval_every: 2" in doc and "wall time" in doc


@pytest.mark.parametrize("torn", ["{\"step\": 1", "[1, 2]"])
def test_samples_reader_skips_torn_or_foreign_lines(tmp_path: Path, torn: str) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"step": 0, "mode": "greedy"}) + "\n" + torn + "\n")
    assert ev.read_samples(path) == [{"step": 0, "mode": "greedy"}]
