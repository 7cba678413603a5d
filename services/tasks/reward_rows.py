"""Scoring a batch row by row when the reward fails on some rows: the rows that can be scored keep
their values, the others are named with the reason. A user's bad row then costs that row, not the
batch: the reward service ends only its task, and an evaluation reports the rows it could score.

On a `RewardError` (the reward raised, returned a non-number, NaN or the wrong count: see
services.tasks.rewards; any other `TaskError` counts as `reward_error`) the batch is split in
halves and each half scored again, down to single rows. A batch of n rows costs at most 2n - 1
calls of the reward (a full binary tree), and a batch with one bad row about 2 log2(n) more than
the one call of a good batch; the reward's timeout bounds them all together. A batched reward is
called on the halves as it would be on any smaller batch; a reward whose value for a row depends
on the other rows of its batch (none should) may then score a row differently than in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.tasks.prompt import Prompt, TaskError
from services.tasks.rewards import RewardError, RewardResult

ScoreBatch = Callable[[Sequence[Prompt], Sequence[str]], RewardResult]


@dataclass(frozen=True)
class RowFailure:
    reason: str  # the dead-letter reason code: reward_error, bad_reward, non_finite_reward
    message: str  # the one line naming the reward and the row


@dataclass
class RowScores:
    """A batch's rewards with holes: `total[i]` (and each component's) is 0.0 for a row in `failed`,
    a placeholder that means nothing; every other value is the reward's, finite."""

    total: list[float]
    components: dict[str, list[float]]
    failed: dict[int, RowFailure] = field(default_factory=dict)
    calls: int = 1  # calls of the reward it took

    @property
    def scored(self) -> int:
        return len(self.total) - len(self.failed)

    def result(self) -> RewardResult:
        """Only for a batch without failures: the plain result."""
        assert not self.failed, "a batch with unscored rows has no plain result"
        return RewardResult(total=self.total, components=self.components)

    def means(self) -> dict[str, float]:
        """Each component's mean over the rows it scored."""
        keep = [i for i in range(len(self.total)) if i not in self.failed]
        return {k: sum(v[i] for i in keep) / len(keep) for k, v in self.components.items() if keep}


def score_rows(score: ScoreBatch, prompts: Sequence[Prompt], completions: Sequence[str]) -> RowScores:
    """`score` on the whole batch, bisecting on a `RewardError` to isolate the rows it fails on."""
    n = len(prompts)
    if len(completions) != n:
        raise RewardError("bad_reward", f"{n} prompts but {len(completions)} completions")
    out = RowScores(total=[0.0] * n, components={}, calls=0)
    if n:
        _score(score, prompts, completions, list(range(n)), out)
    return out


def _score(score: ScoreBatch, prompts: Sequence[Prompt], completions: Sequence[str], rows: list[int],
           out: RowScores) -> None:
    out.calls += 1
    try:
        res = score([prompts[i] for i in rows], [completions[i] for i in rows])
    except TaskError as err:  # RewardError, or a legacy reward that raised TaskError itself
        if len(rows) == 1:
            out.failed[rows[0]] = RowFailure(getattr(err, "reason", "reward_error"), str(err))
            return
        mid = len(rows) // 2
        _score(score, prompts, completions, rows[:mid], out)
        _score(score, prompts, completions, rows[mid:], out)
        return
    for j, i in enumerate(rows):
        out.total[i] = res.total[j]
        for name, values in res.components.items():
            out.components.setdefault(name, [0.0] * len(out.total))[i] = values[j]
