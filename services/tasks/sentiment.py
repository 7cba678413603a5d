"""Sentiment continuation: continue a short sentence opening; the reward is VADER's compound score
of the completion, in [-1, 1].

The vocabulary is word-level: filler words, the words of the openings, and `lexicon_words` sentiment
words drawn from VADER's shipped lexicon (`vader_lexicon.txt`): everyday English candidates (the raw
lexicon's strongest entries are slurs, violence and chat slang, which no demo model should learn)
that the lexicon scores, half the most positive and half the most negative. Supervised warm-up
continuations mix fillers with lexicon words of both signs at rate `lexicon_rate`, so the warmed-up
policy scores around zero on average with real spread: RL has room to raise the score and a signal
to do it with.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import Any

from services.tasks.base import (
    BaseTask,
    Prompt,
    RewardFn,
    TaskError,
    TokenizerKind,
    require_float,
    require_int,
    validate_params,
)

DEFAULTS: dict[str, Any] = {"lexicon_words": 64, "continuation_words": 5, "lexicon_rate": 0.25}

SUBJECTS: tuple[str, ...] = (
    "the movie", "the food", "my day", "the weather", "this book", "our trip", "the service",
    "the hotel", "her song", "his game", "the class", "the show", "my team", "the party",
    "the meeting", "the news", "your plan", "the city", "the room", "the coffee",
)
VERBS: tuple[str, ...] = ("was", "is", "felt", "seemed", "looks", "sounded")
FILLERS: tuple[str, ...] = (
    "and", "the", "a", "it", "to", "of", "in", "on", "with", "about", "for", "at", "then", "so",
    "today", "again", "there", "here", "this", "that", "we", "they", "all", "day", "time", "very",
    "really", "quite", "just", "more", "some", "many", "people", "place", "thing", "week", "night",
    "morning", "after", "before", "around", "over", "also", "still", "as", "usual",
)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Everyday sentiment words; only those VADER's lexicon scores (with the right sign) are used.
POSITIVE_CANDIDATES: tuple[str, ...] = _words("""
    good great nice happy love lovely wonderful amazing awesome excellent fantastic beautiful brilliant
    perfect fun funny glad pleasant cheerful delightful enjoy enjoyed fine best better calm charming
    clever cool comfortable cute easy exciting fresh friendly generous gentle grateful helpful hopeful
    kind laugh like liked lucky peaceful pleased proud relaxed safe smart smile special sweet thankful
    warm welcome win wise wow yes super superb splendid success successful terrific thrilled interesting
    impressive inspiring joy joyful kindly loved optimistic outstanding positive pretty recommend rich
    satisfied strong support talented treasure trust useful valuable vibrant winner worth
""")
NEGATIVE_CANDIDATES: tuple[str, ...] = _words("""
    bad sad awful terrible horrible boring ugly angry annoying annoyed hate hated poor worse worst wrong
    broken cruel dirty dull fail failed failure fear gloomy guilty hard hurt lonely lost mess messy
    miserable nasty noisy pain painful problem rude scary sick sorry stupid tired trouble unhappy upset
    weak weird worried worry disappointing disappointed disaster dreadful gross lame lazy mad nervous
    pathetic stressful tense tragic useless waste wasted bitter confused crappy depressing dislike dumb
    grim hopeless horrid lousy moody sucks unfair unpleasant
""")
_WORD = re.compile(r"^[a-z]+$")


@lru_cache(maxsize=1)
def lexicon() -> dict[str, float]:
    """Single lowercase words and their mean valence from the lexicon file shipped with vaderSentiment."""
    try:
        text = resources.files("vaderSentiment").joinpath("vader_lexicon.txt").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise TaskError(f"task 'sentiment' needs vaderSentiment's vader_lexicon.txt: {err}") from None
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and _WORD.match(parts[0]):
            out[parts[0]] = float(parts[1])
    return out


class SentimentTask(BaseTask):
    name = "sentiment"
    tokenizer_kind: TokenizerKind = "word"

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        reward_override: RewardFn | None = None,
        reward_override_name: str | None = None,
    ):
        super().__init__(reward_override, reward_override_name)
        p = validate_params(self.name, params or {}, DEFAULTS)
        self.n_lexicon = require_int(self.name, "lexicon_words", p["lexicon_words"], 2)
        self.continuation_words = require_int(self.name, "continuation_words", p["continuation_words"], 1, 64)
        self.lexicon_rate = require_float(self.name, "lexicon_rate", p["lexicon_rate"], 0.0, 1.0)
        self.params = {"lexicon_words": self.n_lexicon, "continuation_words": self.continuation_words,
                       "lexicon_rate": self.lexicon_rate}
        scores = lexicon()
        reserved = set(FILLERS) | {w for s in SUBJECTS for w in s.split()} | set(VERBS)
        # Strongest first, ties broken alphabetically so the vocabulary never depends on file order.
        pos = sorted(((w, scores[w]) for w in POSITIVE_CANDIDATES if scores.get(w, 0) > 0 and w not in reserved),
                     key=lambda e: (-e[1], e[0]))
        neg = sorted(((w, scores[w]) for w in NEGATIVE_CANDIDATES if scores.get(w, 0) < 0 and w not in reserved),
                     key=lambda e: (e[1], e[0]))
        half = self.n_lexicon // 2
        if half > min(len(pos), len(neg)) or self.n_lexicon - half > len(pos):
            raise TaskError(f"task '{self.name}': param 'lexicon_words' must be at most"
                            f" {2 * min(len(pos), len(neg))}, got {self.n_lexicon}")
        self.positive_words = [w for w, _ in pos[: self.n_lexicon - half]]
        self.negative_words = [w for w, _ in neg[:half]]
        self.lexicon_words = sorted(self.positive_words + self.negative_words)
        self.max_prompt_tokens = max(len(s.split()) for s in SUBJECTS) + 1  # subject + verb
        self.max_new_tokens = self.continuation_words + 1  # + EOS
        self._analyzer: Any = None
        self._lock = threading.Lock()

    def _make(self, rng: random.Random, index: int) -> Prompt:
        return Prompt(index=index, text=f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)}", answer="")

    def _reward(self, prompt: Prompt, completion: str) -> float:
        if self._analyzer is None:
            with self._lock:
                if self._analyzer is None:
                    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

                    self._analyzer = SentimentIntensityAnalyzer()
        return float(self._analyzer.polarity_scores(completion)["compound"])

    def sft_example(self, index: int) -> tuple[str, str]:
        rng = self._rng("sft", index)
        prompt = self._make(rng, index)
        n = rng.randint(1, self.continuation_words)
        words = [
            rng.choice(self.lexicon_words) if rng.random() < self.lexicon_rate else rng.choice(FILLERS)
            for _ in range(n)
        ]
        return prompt.text, " ".join(words)

    def vocab(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in (*FILLERS, *(w for s in SUBJECTS for w in s.split()), *VERBS, *self.lexicon_words):
            seen.setdefault(w, None)
        return list(seen)
