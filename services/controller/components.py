"""Reward components on the controller's side: which names a ScoreBatch may carry, and each
component's mean over a step's rows for the metrics row (`reward/<name>`)."""

from __future__ import annotations

from typing import Any

from services.core.config.run import RunConfig
from services.rl.wire import Scores


def reward_names(task: Any, cfg: RunConfig) -> frozenset[str]:
    """The configured rewards when there are several; none for one reward or a reward model."""
    if cfg.models.reward is not None or not hasattr(task, "reward_set"):
        return frozenset()
    names = list(task.reward_set().names)
    return frozenset(names) if len(names) > 1 else frozenset()


class ComponentMeans:
    """Each task's component values from its reward ScoreBatch, until its step records their means."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, float]] = {}

    def keep(self, scores: Scores) -> None:
        for name, values in scores.components.items():
            for tid, v in zip(scores.task_ids, values.tolist(), strict=True):
                self._rows.setdefault(tid, {})[name] = float(v)

    def take(self, task_ids: list[str]) -> dict[str, float]:
        """`reward/<name>`: each component's mean over the step's rows; forgets those rows."""
        rows = [p for p in (self._rows.pop(t, None) for t in task_ids) if p]
        names = sorted({n for p in rows for n in p})
        return {f"reward/{n}": sum(p[n] for p in rows if n in p) / sum(n in p for p in rows) for n in names}
