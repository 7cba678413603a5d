"""Prompt datasets and reward functions.

`load_task(section)` builds the task the run config names: a built-in one (`task.name`), rows of a
dataset (`task.source`: jsonl, json, parquet, csv or hf) or a reasoning-gym generator
(`source: reasoning_gym`), and attaches the configured reward: `task.reward_fn`
("module:function" or "path/to/file.py:function"), `task.reward_path`, or several weighted
`task.rewards` (see services.tasks.rewards). Prompts become token ids through
`services.tasks.chat.encode_prompt`, which applies the tokenizer's chat template.

May import: services.core
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.tasks.arithmetic import ArithmeticTask
from services.tasks.base import Prompt, PromptError, RewardFn, Task, TaskError
from services.tasks.rewards import RewardError, RewardResult, RewardSet, build_reward_set, load_callable, make_component
from services.tasks.sentiment import SentimentTask
from services.tasks.synthetic import SyntheticTask

if TYPE_CHECKING:
    from services.core.config.run import TaskSection

log = logging.getLogger(__name__)

TASKS: dict[str, type[ArithmeticTask] | type[SentimentTask] | type[SyntheticTask]] = {
    "arithmetic": ArithmeticTask,
    "sentiment": SentimentTask,
    "synthetic": SyntheticTask,
}

__all__ = ["TASKS", "Prompt", "PromptError", "RewardError", "RewardFn", "RewardResult", "RewardSet", "Task",
           "TaskError", "load_reward_fn", "load_task", "make_task"]


def load_reward_fn(spec: str) -> RewardFn:
    """Import `package.module:function` or `path/to/file.py:function` as a one-sample or batched reward;
    every failure names the string it came from."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise TaskError(f"reward_fn {spec!r} must look like 'package.module:function'"
                        " or 'path/to/file.py:function'")
    fn = load_callable(spec)
    make_component(fn, spec, 1.0, ("answer",), spec=spec)  # signature check
    return fn  # type: ignore[no-any-return]


def make_task(name: str, params: dict[str, Any] | None = None, reward_fn: str | None = None) -> Task:
    cls = TASKS.get(name)
    if cls is None:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    task = cls(params or {})
    if reward_fn:
        fn = load_reward_fn(reward_fn)
        task.rewards = RewardSet([make_component(fn, reward_fn, 1.0, task.field_names, spec=reward_fn)])
        log.info("task %s: reward overridden by %s", name, reward_fn)
    return task


def load_task(section: TaskSection) -> Task:
    task: Task
    if section.source is None:
        task = make_task(section.task_name, dict(section.params))
        task.system_prompt = section.system_prompt
        task.chat = section.chat
    elif section.source == "reasoning_gym":
        from services.tasks.gym import ReasoningGymTask

        task = ReasoningGymTask(section)
    else:
        from services.tasks.dataset import DatasetTask

        if section.params:
            raise TaskError(f"task.params: unused with source {section.source!r} (got {', '.join(section.params)})")
        task = DatasetTask(section)
    rewards = build_reward_set(section, task)
    if rewards is not None:
        task.rewards = rewards  # type: ignore[attr-defined]
    return task
