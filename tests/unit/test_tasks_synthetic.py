"""The synthetic throughput task: fixed-length prompts that tokenize one word per token."""

from __future__ import annotations

import pytest

from services.models.roles.tokenizer import build_tokenizer_from_vocab
from services.tasks import TaskError, make_task
from services.tasks.base import Prompt


def test_prompts_tokenize_to_exactly_prompt_tokens() -> None:
    task = make_task("synthetic", {"prompt_tokens": 64, "completion_tokens": 256, "words": 500})
    tok = build_tokenizer_from_vocab(task.vocab(), "word")
    assert len(tok) == 504
    for i in range(20):
        ids = tok(task.prompt(i).text)["input_ids"]
        assert len(ids) == 64 and min(ids) >= 4 and tok.unk_token_id not in ids
    assert task.prompt(3) == task.prompt(3) and task.prompt(3) != task.eval_prompt(3)
    assert task.max_new_tokens == 256 and task.max_prompt_tokens == 64


def test_reward_is_the_share_of_completion_words_seen_in_the_prompt() -> None:
    task = make_task("synthetic", {"prompt_tokens": 3, "words": 10})
    p = Prompt(0, "w1 w2 w3", "")
    assert task.reward(p, "w1 w9 w2 w8") == 0.5
    assert task.reward(p, "") == 0.0


def test_bad_synthetic_params_name_the_field() -> None:
    with pytest.raises(TaskError, match="prompt_tokens"):
        make_task("synthetic", {"prompt_tokens": 0})
    with pytest.raises(TaskError, match="allowed: completion_tokens, prompt_tokens, words"):
        make_task("synthetic", {"lenght": 3})
