"""Prompt datasets and reward functions.

`load_task(section)` builds the task named in the run config; `task.reward_fn: "module:function"`
replaces the task's rule-based reward with `function(prompt: Prompt, completion: str) -> float`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Any

from services.tasks.arithmetic import ArithmeticTask
from services.tasks.base import Prompt, RewardFn, Task, TaskError
from services.tasks.sentiment import SentimentTask
from services.tasks.synthetic import SyntheticTask

if TYPE_CHECKING:
    from services.core.config import TaskSection

log = logging.getLogger(__name__)

TASKS: dict[str, type[ArithmeticTask] | type[SentimentTask] | type[SyntheticTask]] = {
    "arithmetic": ArithmeticTask,
    "sentiment": SentimentTask,
    "synthetic": SyntheticTask,
}

__all__ = ["TASKS", "Prompt", "RewardFn", "Task", "TaskError", "load_reward_fn", "load_task", "make_task"]


def load_reward_fn(spec: str) -> RewardFn:
    """Import `package.module:function`; every failure names the string it came from."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise TaskError(f"reward_fn {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise TaskError(f"reward_fn {spec!r}: module {module_name!r} not found ({err})") from None
    except Exception as err:  # an import-time error inside the user's module
        raise TaskError(f"reward_fn {spec!r}: importing module {module_name!r} failed: "
                        f"{type(err).__name__}: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"reward_fn {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"reward_fn {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    try:
        inspect.signature(obj).bind(Prompt(0, "", ""), "")
    except TypeError as err:
        raise TaskError(f"reward_fn {spec!r}: must accept (prompt: Prompt, completion: str): {err}") from None
    except ValueError:
        pass  # builtins without an introspectable signature: trust them
    return obj  # type: ignore[no-any-return]


def make_task(name: str, params: dict[str, Any] | None = None, reward_fn: str | None = None) -> Task:
    cls = TASKS.get(name)
    if cls is None:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    override = load_reward_fn(reward_fn) if reward_fn else None
    task = cls(params or {}, reward_override=override, reward_override_name=reward_fn)
    if reward_fn:
        log.info("task %s: reward overridden by %s", name, reward_fn)
    return task


def load_task(section: TaskSection) -> Task:
    return make_task(section.name, dict(section.params), section.reward_fn)
