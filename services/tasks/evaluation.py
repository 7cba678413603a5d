"""Held-out evaluation, the half the local loop and the controller share: which prompts, how they
become token ids, how completions are scored, and what a run records of it (the metrics keys and
the `samples.jsonl` lines). Generation is the caller's: the local loop calls its engine, the
controller the actor's `Generate`.

Both modes run on the same prompts: greedy (argmax) and sampled at the training temperature with a
seed fixed for the run, so an evaluation is reproducible and the fleet's equals the local loop's.
A row the reward cannot score (it raises, returns NaN...) is left out of the means and counted
(`eval_unscored`), as is every row of an evaluation whose reward timed out; the others still count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.tasks.base import Prompt, Task
from services.tasks.chat import encode_prompt
from services.tasks.reward_rows import RowScores, score_rows

# Scores a batch row by row: in-process (`score_rows` on the task's reward) or in a reward worker.
RowScorer = Callable[[Sequence[Prompt], Sequence[str]], RowScores]

Mode = Literal["greedy", "sampled"]
MODES: tuple[Mode, ...] = ("greedy", "sampled")
SAMPLES_FILE = "samples.jsonl"
# Added to run.seed for the sampled evaluation: a stream of its own, apart from every training batch.
EVAL_SEED_OFFSET = 4242


def eval_seed(run_seed: int) -> int:
    return run_seed + EVAL_SEED_OFFSET


def eval_size(task: Task, configured: int) -> int:
    """`task.eval_size`, capped by the held-out prompts the task has (when it says)."""
    have = getattr(task, "eval_count", None)
    return configured if have is None else max(0, min(configured, int(have)))


def eval_prompts(task: Task, n: int) -> list[Prompt]:
    return [task.eval_prompt(i) for i in range(n)]


def encode_eval_prompts(task: Task, tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    return [encode_prompt(task, tokenizer, p) for p in prompts]


@dataclass(frozen=True)
class ModeResult:
    mode: Mode
    completions: list[str]
    # None: the run's reward cannot be computed outside the reward service (a reward model); an
    # element None: a row the reward could not score.
    rewards: list[float | None] | None
    correct_at: float | None

    @property
    def scored(self) -> list[float]:
        return [r for r in self.rewards or () if r is not None]

    @property
    def unscored(self) -> int:
        return 0 if self.rewards is None else len(self.rewards) - len(self.scored)

    @property
    def reward(self) -> float | None:
        rows = self.scored
        return math.fsum(rows) / len(rows) if rows else None

    @property
    def accuracy(self) -> float | None:
        rows = self.scored
        if not rows or self.correct_at is None:
            return None
        return sum(r >= self.correct_at for r in rows) / len(rows)


def score(task: Task, prompts: Sequence[Prompt], completions: Sequence[str], *,
          reward_model: bool, scorer: RowScorer | None = None) -> list[float | None] | None:
    """The task's reward for each completion as the reward service computes it (None for a row it
    could not score); None with a reward model."""
    if reward_model:
        return None
    rows = scorer(prompts, completions) if scorer is not None else score_rows(task.score, prompts, completions)
    return [None if i in rows.failed else v for i, v in enumerate(rows.total)]


def evaluate_mode(task: Task, mode: Mode, prompts: Sequence[Prompt], completions: Sequence[str], *,
                  reward_model: bool, scorer: RowScorer | None = None) -> ModeResult:
    rewards = score(task, prompts, completions, reward_model=reward_model, scorer=scorer)
    return ModeResult(mode, list(completions), rewards, None if reward_model else task.correct_at)


def unscored_result(task: Task, mode: Mode, completions: Sequence[str]) -> ModeResult:
    """An evaluation whose reward could not score any row (it timed out): every row counts unscored."""
    return ModeResult(mode, list(completions), [None] * len(completions), task.correct_at)


def metrics_of(results: Mapping[Mode, ModeResult], suffix: str = "") -> dict[str, float]:
    """The metrics.jsonl keys: eval_reward (sampled, as the local loop always wrote), eval_reward_greedy,
    and eval_accuracy[_greedy] where the task knows what correct is, over the rows the reward scored;
    eval_unscored[_greedy], the rows it could not, when there are any; `suffix` "_before" for the
    evaluation before training."""
    row: dict[str, float] = {}
    for mode, res in results.items():
        tail = "" if mode == "sampled" else "_greedy"
        if res.reward is not None:
            row[f"eval_reward{tail}{suffix}"] = res.reward
        if res.accuracy is not None:
            row[f"eval_accuracy{tail}{suffix}"] = res.accuracy
        if res.unscored:
            row[f"eval_unscored{tail}{suffix}"] = float(res.unscored)
    return row


def sample_lines(step: int, version: int, prompts: Sequence[Prompt], results: Mapping[Mode, ModeResult]) -> list[str]:
    """One samples.jsonl line per completion (step 0 is the evaluation before training)."""
    out = []
    for mode, res in results.items():
        for i, (p, text) in enumerate(zip(prompts, res.completions, strict=True)):
            line: dict[str, Any] = {"step": step, "version": version, "mode": mode, "index": p.index,
                                    "prompt": p.text, "completion": text,
                                    "reward": None if res.rewards is None else res.rewards[i]}
            if p.answer:
                line["answer"] = p.answer
            out.append(json.dumps(line, ensure_ascii=False) + "\n")
    return out


def read_samples(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash is skipped
        if isinstance(doc, dict):
            rows.append(doc)
    return rows
