from __future__ import annotations

import pytest

from services.core.config.run import TaskSection
from services.tasks import TaskError, load_reward_fn, load_task, make_task
from services.tasks.arithmetic import ArithmeticTask
from services.tasks.base import Prompt, Task
from services.tasks.sentiment import SentimentTask

NOT_CALLABLE = 3


def length_reward(prompt: Prompt, completion: str) -> float:
    return float(len(completion))


def text_reward(prompt: Prompt, completion: str) -> str:
    return "high"


def nan_reward(prompt: Prompt, completion: str) -> float:
    return float("nan")


def one_arg_reward(prompt: Prompt) -> float:
    return 0.0


def test_load_task_builds_each_task_by_name_and_they_satisfy_the_protocol() -> None:
    a = load_task(TaskSection(name="arithmetic", params={"max_operand": 5}))
    s = load_task(TaskSection(name="sentiment"))
    assert isinstance(a, ArithmeticTask) and a.max_operand == 5
    assert isinstance(s, SentimentTask)
    assert isinstance(a, Task) and isinstance(s, Task)


def test_unknown_task_name_lists_known_tasks() -> None:
    with pytest.raises(TaskError, match="known tasks: arithmetic, sentiment"):
        make_task("chess")


def test_reward_fn_override_replaces_the_rule_based_reward() -> None:
    task = load_task(TaskSection(name="arithmetic", reward_fn=f"{__name__}:length_reward"))
    p = task.prompt(0)
    assert task.reward(p, "abcd") == 4.0
    assert task.reward(p, p.answer) == float(len(p.answer))


def test_missing_reward_module_error_names_the_string() -> None:
    with pytest.raises(TaskError, match=r"'no_such_pkg\.mod:fn'.*module 'no_such_pkg\.mod' not found"):
        load_reward_fn("no_such_pkg.mod:fn")


def test_missing_reward_attribute_error_names_the_string() -> None:
    spec = f"{__name__}:nope"
    with pytest.raises(TaskError, match="has no attribute 'nope'") as err:
        load_reward_fn(spec)
    assert spec in str(err.value)


def test_non_callable_reward_error_names_the_string() -> None:
    spec = f"{__name__}:NOT_CALLABLE"
    with pytest.raises(TaskError, match="not callable") as err:
        load_reward_fn(spec)
    assert spec in str(err.value)


def test_reward_fn_with_the_wrong_signature_is_rejected_at_load() -> None:
    with pytest.raises(TaskError, match=r"must accept \(prompt: Prompt, completion: str\)"):
        load_reward_fn(f"{__name__}:one_arg_reward")


@pytest.mark.parametrize("spec", ["no_colon", ":fn", "mod:", "a:b:c"])
def test_malformed_reward_fn_string_is_rejected(spec: str) -> None:
    with pytest.raises(TaskError, match="must look like"):
        load_reward_fn(spec)


@pytest.mark.parametrize(("fn", "fragment"), [("text_reward", "returned str"), ("nan_reward", "non-finite")])
def test_override_returning_a_non_float_or_non_finite_value_is_an_error(fn: str, fragment: str) -> None:
    task = make_task("arithmetic", reward_fn=f"{__name__}:{fn}")
    with pytest.raises(TaskError, match=fragment):
        task.reward(task.prompt(0), "1")
