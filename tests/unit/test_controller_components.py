"""The controller's reward components: the names a run accepts, and per-step means over exactly the
step's rows (a batch scored for a later step is kept for it)."""

from __future__ import annotations

import torch

from services.controller.components import ComponentMeans, reward_names
from services.core.config.run import parse_config
from services.rl.wire import Scores
from services.tasks import load_task


def scores(task_ids: list[str], **parts: list[float]) -> Scores:
    return Scores(batch_id="b0", stage="reward", task_ids=task_ids, version=0, tensor=torch.zeros(len(task_ids)),
                  components={k: torch.tensor(v) for k, v in parts.items()})


def test_step_means_cover_only_that_steps_rows_and_forget_them() -> None:
    means = ComponentMeans()
    means.keep(scores(["t0-0", "t0-1"], correct=[1.0, 0.0], brevity=[1.0, 1.0]))
    means.keep(scores(["t1-0", "t1-1"], correct=[1.0, 1.0], brevity=[0.0, 0.0]))
    assert means.take(["t0-0", "t0-1"]) == {"reward/brevity": 1.0, "reward/correct": 0.5}
    assert means.take(["t0-0", "t0-1"]) == {}
    assert means.take(["t1-0", "t1-1"]) == {"reward/brevity": 0.0, "reward/correct": 1.0}


def test_a_run_accepts_components_only_when_it_has_several_rewards(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rewards = tmp_path / "r.py"
    rewards.write_text("def a(completions, **kw):\n    return [1.0] * len(completions)\n\n"
                       "def b(completions, **kw):\n    return [0.0] * len(completions)\n")
    two = parse_config({"task": {"reward_path": str(rewards), "rewards": [{"fn": "a"}, {"fn": "b", "weight": 0.5}]}})
    assert reward_names(load_task(two.task), two) == {"a", "b"}
    one = parse_config({"task": {"reward_path": str(rewards), "rewards": [{"fn": "a"}]}})
    assert reward_names(load_task(one.task), one) == frozenset()
