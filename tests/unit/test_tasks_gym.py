"""reasoning-gym generators as a prompt source, scored by the generator's own score_answer."""

from __future__ import annotations

from typing import Any

import pytest
import reasoning_gym

from services.core.config.run import TaskSection
from services.tasks import TaskError, load_task
from services.tasks.gym import ReasoningGymTask


def _gym(name: str = "basic_arithmetic", **kw: Any) -> ReasoningGymTask:
    task = load_task(TaskSection(source="reasoning_gym", name=name, **kw))
    assert isinstance(task, ReasoningGymTask)
    return task


def test_prompts_are_the_generators_items_deterministic_by_seed_and_held_out_items_are_never_trained() -> None:
    task = _gym(seed=5, eval_size=16, params={"size": 200})
    ref = reasoning_gym.create_dataset("basic_arithmetic", seed=5, size=200)
    assert task.eval_prompt(3).text == ref[3]["question"] and task.eval_prompt(3).answer == ref[3]["answer"]
    assert task.prompt(0).text == ref[16]["question"]
    assert task.prompt(0) == _gym(seed=5, eval_size=16, params={"size": 200}).prompt(0)
    train_items = {task.prompt(i).origin for i in range(400)}
    held_items = {task.eval_prompt(i).origin for i in range(16)}
    assert len(train_items) == 184 and len(held_items) == 16 and not train_items & held_items
    other = _gym(seed=6, eval_size=16)
    assert [other.eval_prompt(i).text for i in range(8)] != [task.eval_prompt(i).text for i in range(8)]


def test_the_reward_is_the_generators_score_answer() -> None:
    task = _gym("chain_sum", eval_size=4)
    p = task.prompt(0)
    assert task.reward(p, f" {p.answer}\n") == 1.0
    assert task.reward(p, str(int(p.answer) + 1)) == 0.0
    assert set(p.fields) == {"metadata", "question"} and p.fields["metadata"]["source_dataset"] == "chain_sum"


def test_an_answer_tag_reads_the_answer_from_the_tagged_span() -> None:
    task = _gym(eval_size=4, params={"answer_tag": "answer"})
    p = task.prompt(1)
    assert task.reward(p, f"thinking... <answer>{p.answer}</answer>") == 1.0
    assert task.reward(p, p.answer) == 0.0  # no tags: no answer
    _, a = task.sft_example(1)
    assert a == f"<answer>{p.answer}</answer>"


def test_answer_from_last_number_reads_the_last_number_the_completion_writes() -> None:
    task = _gym("chain_sum", eval_size=4, params={"answer_from": "last_number"})
    p = task.prompt(0)
    assert task.reward(p, f"The answer to 1 + 2 is {p.answer}.") == 1.0
    assert task.reward(p, f"{p.answer} is wrong, it is {int(p.answer) + 1}") == 0.0
    assert task.reward(p, "no number here") == 0.0
    assert task.extract("it is -1,204.5, I think") == "-1,204.5" and task.extract("7,") == "7"
    with pytest.raises(TaskError, match=r"answer_from: got 'first'; allowed values: 'completion', 'last_number'"):
        _gym(eval_size=4, params={"answer_from": "first"})
    with pytest.raises(TaskError, match="exclude each other"):
        _gym(eval_size=4, params={"answer_from": "last_number", "answer_tag": "answer"})


def test_generator_params_reach_the_generator() -> None:
    task = _gym(eval_size=4, params={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    for i in range(20):
        assert task.prompt(i).fields["metadata"]["num_terms"] == 2


def test_an_unknown_generator_or_generator_param_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match=r"'no_such_gen' is not a reasoning-gym generator; known: .*basic_arithmetic"):
        _gym("no_such_gen")
    with pytest.raises(TaskError, match=r"task\.params for reasoning-gym 'basic_arithmetic'"):
        _gym(params={"colour": "blue"})
    with pytest.raises(TaskError, match=r"task\.params\.size must be an integer above task\.eval_size"):
        _gym(eval_size=64, params={"size": 10})
