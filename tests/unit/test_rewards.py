"""Reward functions: batched (TRL-style) and one-sample forms, every mapped field handed over,
user code imported from a file path, math-verify, weighted components, and a named rejection
for a reward that raises or returns a string, NaN or the wrong number of values."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from services.core.config.run import TaskSection
from services.core.serving.worker import rejection_reason
from services.models.engine import Completion, completions_to_rollout
from services.models.roles.tokenizer import build_tokenizer
from services.reward.scorer import BadReward, RewardScorer
from services.tasks import RewardError, TaskError, load_task
from services.tasks.base import Prompt
from services.tasks.chat import encode_prompts
from services.tasks.rewards import math_verify_reward

ROOT = Path(__file__).resolve().parents[2]

REWARDS = '''
import math

CALLS = []

def batched(completions, prompts, answer, difficulty, **kw):
    CALLS.append({"completions": completions, "prompts": prompts, "answer": answer,
                  "difficulty": difficulty, "extra": sorted(kw)})
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def length(prompt, completion):
    return float(len(completion))

def by_level(prompt, completion, difficulty):
    return float(difficulty)

def reward(completions, **kw):
    return [0.5] * len(completions)

def nan(completions, **kw):
    return [math.nan] * len(completions)

def text(prompt, completion):
    return "high"

def short(completions, **kw):
    return [1.0]

def boom(prompt, completion):
    raise KeyError("missing")

def needs_gold(completions, gold):
    return [0.0] * len(completions)
'''


@pytest.fixture
def data(tmp_path: Path) -> dict[str, str]:
    rows = [{"q": f"{i}+1=", "a": str(i + 1), "level": i % 3, "src": "gen"} for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    return {"source": "jsonl", "path": str(tmp_path / "d.jsonl"), "prompt_field": "q", "answer_field": "a",
            "fields": {"difficulty": "level"}, "eval_size": 2, "reward_path": str(tmp_path / "my_rewards.py")}


def _section(data: dict[str, str], **kw: Any) -> TaskSection:
    return TaskSection(**{**data, **kw})


def test_a_batched_reward_gets_completions_prompts_and_every_mapped_field_as_lists(data: dict[str, str]) -> None:
    task = load_task(_section(data, rewards=[{"fn": "batched"}]))
    prompts = [task.prompt(i) for i in range(3)]
    res = task.score(prompts, [prompts[0].answer, "nope", f" {prompts[2].answer} "])
    assert res.total == [1.0, 0.0, 1.0] and res.components == {"batched": [1.0, 0.0, 1.0]}
    mod = sys.modules[task.rewards.components[0].fn.__module__]  # type: ignore[attr-defined]
    call = mod.CALLS[-1]
    assert call["prompts"] == [p.text for p in prompts]
    assert call["answer"] == [p.answer for p in prompts]
    assert call["difficulty"] == [p.fields["difficulty"] for p in prompts]
    assert call["extra"] == ["src"]  # unmapped columns travel under their own names


def test_one_sample_rewards_keep_working_and_may_name_fields(data: dict[str, str]) -> None:
    task = load_task(_section(data, rewards=[{"fn": "length"}, {"fn": "by_level", "weight": 2.0}]))
    p = task.prompt(0)
    res = task.score([p], ["abc"])
    assert res.components == {"length": [3.0], "by_level": [float(p.fields["difficulty"])]}
    assert res.total == [3.0 + 2.0 * p.fields["difficulty"]]


def test_weighted_components_sum_and_each_is_reported(data: dict[str, str]) -> None:
    task = load_task(_section(data, rewards=[{"fn": "task", "weight": 0.5}, {"fn": "reward", "weight": -1.0},
                                             {"fn": "math_verify", "name": "math"}]))
    p = task.prompt(4)
    res = task.score([p, p], [p.answer, "x"])
    assert res.components == {"task": [1.0, 0.0], "reward": [0.5, 0.5], "math": [1.0, 0.0]}
    assert res.total == [0.5 - 0.5 + 1.0, -0.5]


def test_reward_path_alone_uses_its_function_named_reward_and_path_colon_function_picks_one(data: dict[str, str]
                                                                                           ) -> None:
    assert load_task(_section(data)).score([load_task(_section(data)).prompt(0)], ["z"]).total == [0.5]
    one = load_task(_section(data, reward_path=f"{data['reward_path']}:length"))
    assert one.reward(one.prompt(0), "abcd") == 4.0
    fn = load_task(_section({**data, "reward_path": None}, reward_fn=f"{data['reward_path']}:length"))
    assert fn.reward(fn.prompt(0), "ab") == 2.0


def test_a_reward_file_imports_in_a_process_without_pythonpath_for_it(data: dict[str, str], tmp_path: Path) -> None:
    code = (f"from services.core.config.run import TaskSection\nfrom services.tasks import load_task\n"
            f"t = load_task(TaskSection(**{data!r}, rewards=[{{'fn': 'length'}}]))\n"
            "print('REWARD', t.reward(t.prompt(0), 'abcde'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(Path.home())})
    assert "REWARD 5.0" in out.stdout, out.stderr[-2000:]


def test_math_verify_accepts_equal_answers_in_other_forms_also_off_the_main_thread() -> None:
    gold = Prompt(0, "What is 1/2 as a decimal?", "0.5")
    cases = [("The answer is $\\boxed{\\frac{1}{2}}$.", 1.0), ("I get 0.5", 1.0), ("it is 0.75", 0.0), ("", 0.0)]
    assert [math_verify_reward(gold, c) for c, _ in cases] == [v for _, v in cases]
    with ThreadPoolExecutor(1) as pool:  # the reward service scores in a worker thread
        assert pool.submit(math_verify_reward, gold, "\\boxed{1/2}").result() == 1.0


@pytest.mark.parametrize(("fn", "reason", "fragment"), [
    ("nan", "non_finite_reward", "returned a non-finite reward nan"),
    ("text", "bad_reward", "returned str, expected a float"),
    ("short", "bad_reward", "returned 1 values for a batch of 2"),
    ("boom", "reward_error", "raised KeyError: 'missing'"),
])
def test_a_bad_reward_is_a_named_rejection_naming_the_reward_and_row(data: dict[str, str], fn: str, reason: str,
                                                                     fragment: str) -> None:
    task = load_task(_section(data, rewards=[{"fn": fn}]))
    prompts = [task.prompt(0), task.prompt(1)]
    with pytest.raises(RewardError, match=rf"reward '{fn}' {fragment}") as err:
        task.score(prompts, ["1", "2"])
    assert err.value.reason == reason
    if fn in ("nan", "text", "boom"):
        assert prompts[0].origin in str(err.value)


def test_a_reward_needing_a_field_the_data_lacks_fails_at_load(data: dict[str, str]) -> None:
    with pytest.raises(TaskError, match=r"needs field\(s\) 'gold' that the data does not have \(fields: answer, "
                                        r"difficulty, src\)"):
        load_task(_section(data, rewards=[{"fn": "needs_gold"}]))


def test_bad_reward_specs_are_clear_errors(data: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"reward file '.*missing\.py' not found"):
        load_task(_section(data, reward_path=str(tmp_path / "missing.py")))
    with pytest.raises(TaskError, match=r"file '.*my_rewards\.py' has no attribute 'nope'"):
        load_task(_section(data, rewards=[{"fn": "nope"}]))
    with pytest.raises(TaskError, match=r"more than one component named 'length'"):
        load_task(_section(data, rewards=[{"fn": "length"}, {"fn": "length"}]))
    with pytest.raises(TaskError, match=r"set task\.reward_path"):
        load_task(_section({**data, "reward_path": None}, rewards=[{"fn": "length"}]))


def _rollout(task: Any, tok: Any, indices: list[int], completions: list[str]) -> Any:
    prompts = encode_prompts(task, tok, indices)
    comps = [Completion(list(tok(c, add_special_tokens=False)["input_ids"]), [0.0] * len(c), "stop")
             for c in completions]
    return completions_to_rollout([f"t{i}-0" for i in indices], prompts, comps, indices, 0, tok.pad_token_id)


def test_the_scorer_returns_the_total_and_each_component_per_row() -> None:
    task = load_task(TaskSection(name="arithmetic", rewards=[{"fn": "task"}, {"fn": "math_verify", "weight": 0.5}]))
    tok = build_tokenizer(task)
    scorer = RewardScorer(task, tok)
    answers = [task.prompt(i).answer for i in range(3)]
    r = _rollout(task, tok, [0, 1, 2], [answers[0], "99", answers[2]])
    total, parts = scorer.score_with_components(r)
    assert total.tolist() == [1.5, 0.0, 1.5]
    assert {k: v.tolist() for k, v in parts.items()} == {"task": [1.0, 0.0, 1.0], "math_verify": [1.0, 0.0, 1.0]}
    assert scorer.last_components == pytest.approx({"task": 2 / 3, "math_verify": 2 / 3})
    assert torch.equal(scorer.score(r), total)


def test_the_scorer_turns_a_bad_reward_into_a_rejection_the_worker_dead_letters(data: dict[str, str]) -> None:
    task = load_task(_section(data, rewards=[{"fn": "nan"}]))
    tok = build_tokenizer(load_task(TaskSection(name="arithmetic")))
    with pytest.raises(BadReward) as err:
        RewardScorer(task, tok).score(_rollout(task, tok, [0, 1], ["1", "2"]))
    assert rejection_reason(err.value) == "non_finite_reward"
    assert "reward 'nan' returned a non-finite reward nan" in str(err.value)
