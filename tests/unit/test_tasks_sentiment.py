from __future__ import annotations

import statistics

import pytest

from services.tasks import TaskError, make_task
from services.tasks.base import Prompt
from services.tasks.sentiment import FILLERS, SentimentTask, lexicon


@pytest.fixture(scope="module")
def task() -> SentimentTask:
    return SentimentTask()


def test_reward_is_vader_compound_of_the_completion_in_range(task: SentimentTask) -> None:
    p = Prompt(0, "the movie was", "")
    good, bad, neutral = (task.reward(p, t) for t in ("great and wonderful", "awful and boring", "the day"))
    assert 0 < good <= 1 and -1 <= bad < 0 and neutral == 0.0
    assert task.reward(p, "") == 0.0


def test_sentiment_vocabulary_is_drawn_from_the_vader_lexicon_and_balanced(task: SentimentTask) -> None:
    scores = lexicon()
    assert len(task.positive_words) == len(task.negative_words) == 32
    assert all(scores[w] > 0 for w in task.positive_words)
    assert all(scores[w] < 0 for w in task.negative_words)
    vocab = set(task.vocab())
    assert set(task.lexicon_words) <= vocab and set(FILLERS) <= vocab
    assert len(task.vocab()) == len(vocab)  # no duplicates


def test_prompts_and_sft_examples_only_use_vocabulary_words(task: SentimentTask) -> None:
    vocab = set(task.vocab())
    for i in range(100):
        text, completion = task.sft_example(i)
        assert set(text.split()) <= vocab and set(completion.split()) <= vocab
        assert 1 <= len(completion.split()) <= task.continuation_words
        assert set(task.prompt(i).text.split()) <= vocab
        assert len(task.prompt(i).text.split()) <= task.max_prompt_tokens


def test_sft_continuations_are_neutral_on_average_with_spread(task: SentimentTask) -> None:
    rewards = [task.reward(task.prompt(i), task.sft_example(i)[1]) for i in range(400)]
    assert abs(statistics.mean(rewards)) < 0.1
    assert statistics.pstdev(rewards) > 0.2


def test_prompts_are_deterministic_and_splits_differ(task: SentimentTask) -> None:
    other = SentimentTask()
    assert [task.prompt(i) for i in range(20)] == [other.prompt(i) for i in range(20)]
    assert [task.prompt(i).text for i in range(20)] != [task.eval_prompt(i).text for i in range(20)]
    assert task.prompt(3).answer == ""


def test_unknown_param_error_names_the_allowed_keys() -> None:
    with pytest.raises(TaskError) as err:
        make_task("sentiment", {"vocab": 10})
    assert all(k in str(err.value) for k in ("vocab", "lexicon_words", "continuation_words", "lexicon_rate"))


def test_too_many_lexicon_words_is_an_error_with_the_limit() -> None:
    with pytest.raises(TaskError, match="lexicon_words' must be at most"):
        SentimentTask({"lexicon_words": 10_000})
