"""Reward functions: user code loaded by module or by file path, in the one-sample form
`fn(prompt: Prompt, completion: str) -> float` or the whole-batch form TRL users write,
`fn(completions: list[str], prompts: list, **fields) -> list[float]`; built-in verifiable rewards;
and weighted sums whose components are reported next to the total.

A function is batched when it has a parameter named `completions`. Either form receives the row's
fields (the answer and every other data column, under their mapped names) as keyword arguments
when it names them or takes `**kwargs`. Every value is checked: a reward that raises, returns a
string, None, the wrong number of values, or NaN/inf is a `RewardError` naming the reward and the
row, with a `reason` the reward service dead-letters the batch under (the run goes on).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from services.tasks.prompt import Prompt, TaskError

if TYPE_CHECKING:
    from services.core.config.run import TaskSection
    from services.tasks.base import Task

log = logging.getLogger("rlfleet.rewards")

BUILTIN_REWARDS: tuple[str, ...] = ("task", "math_verify")


class RewardError(TaskError):
    """A reward that cannot be computed for a batch; `reason` is the dead-letter reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RewardResult:
    # The weighted sum per row.
    total: list[float]
    # Each component's unweighted value per row, by component name.
    components: dict[str, list[float]]

    def means(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self.components.items() if v}


# -- loading user code -----------------------------------------------------------------------------
_file_lock = threading.Lock()


def import_file(path: str | Path) -> ModuleType:
    """Import a Python file by path (once per process), so no service needs PYTHONPATH for it."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise TaskError(f"reward file {str(path)!r} not found")
    # One module per file, named after its path so two `rewards.py` files never collide.
    name = f"rlfleet_user.{p.stem}_{hashlib.sha1(str(p).encode()).hexdigest()[:10]}"
    with _file_lock:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, p)
        if spec is None or spec.loader is None:
            raise TaskError(f"reward file {str(path)!r} cannot be imported (not a Python file?)")
        module = importlib.util.module_from_spec(spec)
        # Siblings of the file (helpers it imports) resolve without PYTHONPATH; appended so they
        # never shadow an installed package.
        if str(p.parent) not in sys.path:
            sys.path.append(str(p.parent))
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise TaskError(f"reward file {str(path)!r}: importing it failed: {type(err).__name__}: {err}") from err
    return module


def _import_module(spec: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise TaskError(f"reward_fn {spec!r}: module {module_name!r} not found ({err})") from None
    except Exception as err:  # an import-time error inside the user's module
        raise TaskError(f"reward_fn {spec!r}: importing module {module_name!r} failed: "
                        f"{type(err).__name__}: {err}") from err


def load_callable(spec: str, reward_path: str | None = None) -> Callable[..., Any]:
    """`package.module:function`, `path/to/file.py:function`, or a bare `function` defined in the
    file `reward_path`; every failure names the string it came from."""
    where, sep, attr = spec.rpartition(":")
    if not sep:
        where, attr = "", spec
    if ":" in where or not attr or (sep and not where):
        raise TaskError(f"reward_fn {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    if not where:
        if reward_path is None:
            raise TaskError(f"reward {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'"
                            " (or set task.reward_path to the file that defines it)")
        module, origin = import_file(reward_path.partition(":")[0]), reward_path.partition(":")[0]
    elif where.endswith(".py"):
        module, origin = import_file(where), where
    else:
        module, origin = _import_module(spec, where), where
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            kind = "file" if origin.endswith(".py") else "module"
            raise TaskError(f"reward_fn {spec!r}: {kind} {origin!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"reward_fn {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


# -- calling conventions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    name: str
    weight: float
    fn: Callable[..., Any]
    batched: bool
    # Field keywords to pass; None: every field (the function takes **kwargs).
    keywords: tuple[str, ...] | None
    # Batched functions only: whether to pass `prompts` (a function may not name it).
    wants_prompts: bool = True

    def _kwargs(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        if self.keywords is None:
            return dict(fields)
        return {k: fields[k] for k in self.keywords if k in fields}

    def values(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        if not self.batched:
            return self._check([self._one(p, c) for p, c in zip(prompts, completions, strict=True)], prompts)
        rows = [p.reward_fields() for p in prompts]
        names = set().union(*rows) if self.keywords is None else set(self.keywords)
        kw: dict[str, Any] = {k: [r.get(k) for r in rows] for k in names}
        if self.wants_prompts:
            kw["prompts"] = [list(p.messages) if p.messages is not None else p.text for p in prompts]
        try:
            raw = self.fn(completions=list(completions), **kw)
        except Exception as err:
            where = prompts[0].where() if len(prompts) == 1 else f"a batch of {len(prompts)} from {prompts[0].where()}"
            raise RewardError("reward_error", f"reward '{self.name}' raised {type(err).__name__}: {err}"
                              f" (on {where})") from err
        return self._check(raw, prompts)

    def _one(self, prompt: Prompt, completion: str) -> Any:
        try:
            return self.fn(prompt, completion, **self._kwargs(prompt.reward_fields()))
        except Exception as err:
            raise RewardError("reward_error", f"reward '{self.name}' raised {type(err).__name__}: {err}"
                              f" (on {prompt.where()})") from err

    def _check(self, raw: Any, prompts: Sequence[Prompt]) -> list[float]:
        n = len(prompts)
        if hasattr(raw, "tolist") and not isinstance(raw, str | bytes):  # numpy arrays, tensors
            raw = raw.tolist()
        if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Sequence):
            raise RewardError("bad_reward", f"reward '{self.name}' returned {type(raw).__name__},"
                              f" expected a list of {n} floats")
        if len(raw) != n:
            raise RewardError("bad_reward", f"reward '{self.name}' returned {len(raw)} values for a batch of {n}")
        out: list[float] = []
        for p, v in zip(prompts, raw, strict=True):
            if isinstance(v, str | bytes) or v is None:
                raise RewardError("bad_reward", f"reward '{self.name}' returned {type(v).__name__}, expected a float"
                                  f" (on {p.where()})")
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise RewardError("bad_reward", f"reward '{self.name}' returned {type(v).__name__}, expected a float"
                                  f" (on {p.where()})") from None
            if not math.isfinite(f):
                raise RewardError("non_finite_reward", f"reward '{self.name}' returned a non-finite reward {f}"
                                  f" (on {p.where()})")
            out.append(f)
        return out


_PLAIN = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def make_component(fn: Callable[..., Any], name: str, weight: float, field_names: Sequence[str],
                   spec: str | None = None) -> Component:
    """Classify `fn` (batched or per-sample) and check that the data has every field it requires."""
    label = spec or name
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without an introspectable signature: trust them
        return Component(name, weight, fn, batched=False, keywords=())
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    available = set(field_names)
    if "completions" in params:
        named = [n for n, p in params.items() if p.kind in _PLAIN and n not in ("completions", "prompts")]
        required = [n for n in named if params[n].default is inspect.Parameter.empty]
        positional_only = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
        if positional_only:
            raise TaskError(f"reward_fn {label!r}: batched rewards are called by keyword;"
                            f" {', '.join(positional_only)} cannot be positional-only")
        _require_fields(label, required, available)
        keywords = None if var_kw else tuple(n for n in named if n in available)
        return Component(name, weight, fn, batched=True, keywords=keywords,
                         wants_prompts=var_kw or "prompts" in params)
    plain = [n for n, p in params.items() if p.kind in (*_PLAIN, inspect.Parameter.POSITIONAL_ONLY)]
    extras = plain[2:]
    required = [n for n in extras if params[n].default is inspect.Parameter.empty]
    _require_fields(label, required, available)
    keywords = None if var_kw else tuple(n for n in extras if n in available)
    try:
        inspect.signature(fn).bind(Prompt(0, "", ""), "", **{k: None for k in keywords or ()})
    except TypeError as err:
        raise TaskError(f"reward_fn {label!r}: must accept (prompt: Prompt, completion: str) or"
                        f" (completions: list[str], prompts: list, **fields): {err}") from None
    return Component(name, weight, fn, batched=False, keywords=keywords)


def _require_fields(label: str, required: Sequence[str], available: set[str]) -> None:
    missing = [n for n in required if n not in available]
    if missing:
        raise TaskError(f"reward_fn {label!r} needs field(s) {', '.join(map(repr, missing))} that the data does"
                        f" not have (fields: {', '.join(sorted(available)) or 'none'})")


# -- built-in verifiable rewards -------------------------------------------------------------------
def math_verify_reward(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion's final answer is mathematically equal to the reference answer
    (math-verify parses LaTeX, boxed answers and plain expressions), else 0.0."""
    from math_verify import parse, verify

    if not prompt.answer:
        return 0.0
    # math-verify bounds its parsers with SIGALRM, which only the main thread may set; the reward
    # service scores in a worker thread, where it must run without that timeout.
    t = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(prompt.answer if "$" in prompt.answer or "\\" in prompt.answer else f"${prompt.answer}$",
                 parsing_timeout=t)  # type: ignore[arg-type]
    pred = parse(completion, parsing_timeout=t)  # type: ignore[arg-type]
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


# -- sets ------------------------------------------------------------------------------------------
class RewardSet:
    """The reward of a run: one or more components; `score` returns the weighted total and each part."""

    def __init__(self, components: Sequence[Component]) -> None:
        if not components:
            raise TaskError("a reward needs at least one function")
        names = [c.name for c in components]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TaskError(f"task.rewards: more than one component named {', '.join(map(repr, dup))};"
                            " give each a distinct 'name'")
        self.components = list(components)

    @classmethod
    def of_task(cls, task: Any, name: str = "task") -> RewardSet:
        fn = getattr(task, "base_reward", task.reward)
        return cls([Component(name, 1.0, fn, batched=False, keywords=())])

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> RewardResult:
        if len(prompts) != len(completions):
            raise RewardError("bad_reward", f"{len(prompts)} prompts but {len(completions)} completions")
        parts = {c.name: c.values(prompts, completions) for c in self.components}
        if len(self.components) == 1:  # exact: no multiply-add on a single weight-1 reward
            c = self.components[0]
            vals = parts[c.name]
            total = vals if c.weight == 1.0 else [c.weight * v for v in vals]
        else:
            total = [math.fsum(c.weight * parts[c.name][i] for c in self.components) for i in range(len(prompts))]
        return RewardResult(total=list(total), components=parts)


def _builtin(name: str, task: Task) -> Callable[..., Any]:
    if name == "task":
        return getattr(task, "own_reward", task.reward)
    return math_verify_reward


def configured_reward(section: TaskSection) -> bool:
    """Whether the config names a reward (user code, or built-ins it combines) rather than the task's own."""
    return bool(section.rewards or section.reward_fn or section.reward_path)


def build_reward_set(section: TaskSection, task: Task) -> RewardSet | None:
    """The reward the config asks for (`rewards`, `reward_fn` or `reward_path`); None: the task's own."""
    specs: list[tuple[str, float, str | None]]
    if section.rewards:
        specs = [(r.fn, r.weight, r.name) for r in section.rewards]
    elif section.reward_fn:
        specs = [(section.reward_fn, 1.0, None)]
    elif section.reward_path and ":" in section.reward_path:
        specs = [(section.reward_path, 1.0, None)]
    elif section.reward_path:
        specs = [("reward", 1.0, None)]
    else:
        return None
    fields = tuple(task.field_names)
    components = []
    for fn_spec, weight, name in specs:
        if fn_spec in BUILTIN_REWARDS:
            fn = _builtin(fn_spec, task)
            label = name or fn_spec
            components.append(make_component(fn, label, weight, fields, spec=fn_spec))
            continue
        fn = load_callable(fn_spec, section.reward_path)
        label = name or getattr(fn, "__name__", None) or fn_spec.rpartition(":")[2]
        components.append(make_component(fn, label, weight, fields, spec=fn_spec))
    out = RewardSet(components)
    log.info("rewards: %s", ", ".join(f"{c.name} x {c.weight:g}" + (" (batched)" if c.batched else "")
                                      for c in out.components))
    return out
