from __future__ import annotations

import pytest

from services.tasks import TaskError, make_task
from services.tasks.arithmetic import ArithmeticTask
from services.tasks.base import Prompt


def _prompt(answer: str) -> Prompt:
    return Prompt(index=0, text="12+7=", answer=answer)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("19", 1.0), (" 19", 1.0), ("19 ", 1.0), ("\n19\n", 1.0), ("190", 0.0), ("1", 0.0), ("", 0.0),
     ("18", 0.0), ("19=19", 0.0), ("1 9", 0.0)],
)
def test_reward_is_one_only_for_an_exact_match_after_stripping_whitespace(completion: str, expected: float) -> None:
    assert ArithmeticTask().reward(_prompt("19"), completion) == expected


def test_negative_answers_match_exactly() -> None:
    task = ArithmeticTask({"ops": "-"})
    p = Prompt(0, "3-7=", "-4")
    assert task.reward(p, "-4") == 1.0
    assert task.reward(p, "4") == 0.0


def test_prompts_are_deterministic_correct_and_within_params() -> None:
    a, b = ArithmeticTask({"max_operand": 9, "ops": "+-"}), ArithmeticTask({"max_operand": 9, "ops": "-+"})
    ops_seen = set()
    for i in range(200):
        p = a.prompt(i)
        assert p == b.prompt(i)  # same index, same prompt, in any instance (and process)
        assert p.index == i and p.text.endswith("=")
        expr = p.text[:-1]
        op = "+" if "+" in expr else "-"
        ops_seen.add(op)
        x, y = (int(v) for v in expr.split(op))
        assert 0 <= x <= 9 and 0 <= y <= 9
        assert p.answer == str(x + y if op == "+" else x - y)
    assert ops_seen == {"+", "-"}


def test_eval_split_is_a_different_stream_from_train() -> None:
    task = ArithmeticTask({"max_operand": 1000})
    train = [task.prompt(i).text for i in range(50)]
    evals = [task.eval_prompt(i).text for i in range(50)]
    assert train != evals
    assert len(set(train) & set(evals)) < 5


def test_sft_examples_pair_a_prompt_with_its_answer() -> None:
    task = ArithmeticTask()
    for i in range(50):
        text, completion = task.sft_example(i)
        x, y = (int(v) for v in text[:-1].split("+"))
        assert completion == str(x + y)


def test_unknown_param_error_names_the_allowed_keys() -> None:
    with pytest.raises(TaskError) as err:
        make_task("arithmetic", {"max_operandz": 5})
    msg = str(err.value)
    assert "max_operandz" in msg and "max_operand" in msg and "ops" in msg


@pytest.mark.parametrize(
    ("params", "fragment"),
    [({"ops": "*"}, "'ops'"), ({"ops": ""}, "'ops'"), ({"ops": "++"}, "'ops'"), ({"max_operand": 0}, "max_operand"),
     ({"max_operand": "20"}, "max_operand"), ({"max_operand": True}, "max_operand")],
)
def test_invalid_param_values_are_rejected_by_name(params: dict[str, object], fragment: str) -> None:
    with pytest.raises(TaskError, match=fragment):
        ArithmeticTask(params)


def test_negative_prompt_index_is_rejected() -> None:
    with pytest.raises(TaskError, match="non-negative"):
        ArithmeticTask().prompt(-1)


def test_token_budgets_cover_every_prompt_and_answer() -> None:
    task = ArithmeticTask({"max_operand": 99, "ops": "+-"})
    for i in range(300):
        p = task.prompt(i)
        assert len(p.text) <= task.max_prompt_tokens  # char-level: one token per character
        assert len(p.answer) + 1 <= task.max_new_tokens  # + EOS
