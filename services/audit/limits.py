"""The bounds the audit holds a run to (`Limits`), resolved from the run's own config and the
caller's `limits`.

Queue limits, from the run config (a depth is stream entries, what `Bus.stream_depths` reports;
every entry on prompts, rollouts and scores carries at least one in-flight task, so a bound in
tasks also bounds entries):

    window   = RunConfig.admission_window = (flow.max_staleness + 1) * samples_per_step
                                   + (batch.prompts_per_message - 1) * algo.group_size
                                   the controller admits a prompt message only while
                                   in_flight + its tasks <= window, so in flight never exceeds it
                                   (`limits["max_in_flight"]` overrides)
    prompts  <= window             entries not yet generated are tasks in flight
    rollouts <= flow.stream_capacity + window
                                   backpressure stops the actor at the high watermark (<= capacity
                                   per scoring group); what it had already taken, at most the
                                   window, can still land on top
    scores   <= window * len(stages)   one score entry per task and stage at most
    dead     unbounded             dead letters are kept for people; maximum reported
    other    <= flow.stream_capacity + window

each multiplied by `limits["queue_headroom"]` (default 1.0). `limits["queue_depth"]` replaces the
formula: an int for every stream, or a dict keyed by short stream name. A stream key such as
`rlfleet:<run>:rollouts:critic` is classified by its `prompts`/`rollouts`/`scores`/`dead` segment.
RSS is bounded only when `limits["rss_bytes"]` is given (int for every service, or dict per
service, `"*"` for any service not named). Disk is bounded only when `limits["disk_bytes"]` is
given.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.core.config.run import ConfigError, RunConfig, load_config

# Strict: a bool or a float is not a count, and a string is never coerced into one.
Count = Annotated[int, Field(ge=0, strict=True)]

# Values a run config holds; a caller's limits supply them only when RUN_DIR/fleet.yaml is absent.
CONFIG_KEYS = ("max_staleness", "stream_capacity", "max_steps", "samples_per_step", "stages", "trainable")
# Resource limits; the run config has none.
RESOURCE_KEYS = ("queue_headroom", "queue_depth", "rss_bytes", "disk_bytes", "max_in_flight")
LIMIT_KEYS = frozenset(CONFIG_KEYS + RESOURCE_KEYS)
STREAM_CLASSES = ("prompts", "rollouts", "scores", "dead")


class AuditError(RuntimeError):
    """The run cannot be audited at all (exit code 2): no journal, unreadable config, bad limits."""


def stream_class(stream: str) -> str:
    """`prompts`, `rollouts`, `scores`, `dead` or `other`, from a short name or a full stream key
    (`rlfleet:<run>:rollouts`, `rollouts:critic`, `queue_prompts`)."""
    parts = [p for chunk in stream.split(":") for p in chunk.split("_")]
    for cls in ("dead", "rollouts", "scores", "prompts"):
        if cls in parts:
            return cls
    return "other"


class Limits(BaseModel):
    """The bounds the audit holds the run to, and where each came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_staleness: Count
    stream_capacity: Count
    max_steps: Count
    samples_per_step: Count
    admission_window: Count
    stages: tuple[str, ...]
    trainable: tuple[str, ...]
    queue_headroom: Annotated[float, Field(gt=0, strict=True)] = 1.0
    queue_depth: Count | dict[str, Count] | None = None
    rss_bytes: Count | dict[str, Count] | None = None
    disk_bytes: Count | None = None
    max_in_flight: Count | None = None
    # From the run's config only (0 / the default without one): what dynamic sampling is checked against.
    group_size: Count = 0
    dynamic_sampling_tol: Annotated[float, Field(ge=0)] = 1e-6
    source: str = "defaults"

    @field_validator("stages", "trainable", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        # Names given as any sequence become strings; a non-sequence fails the tuple type.
        return tuple(str(s) for s in v) if isinstance(v, list | tuple) else v

    @field_validator("queue_depth", "rss_bytes", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        return {str(k): x for k, x in v.items()} if isinstance(v, dict) else v

    @field_validator("queue_headroom", mode="before")
    @classmethod
    def _headroom(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @property
    def in_flight_ceiling(self) -> int:
        """Most tasks in flight: the admission window unless `max_in_flight` overrides it."""
        return self.admission_window if self.max_in_flight is None else self.max_in_flight

    def queue_limit(self, stream: str) -> int | None:
        """Most entries `stream` may hold; None: unbounded (dead letters)."""
        cls = stream_class(stream)
        if isinstance(self.queue_depth, int):
            return self.queue_depth
        if isinstance(self.queue_depth, dict):
            for key in (stream, cls):
                if key in self.queue_depth:
                    return self.queue_depth[key]
        ceiling = self.in_flight_ceiling
        base: int | None
        if cls == "prompts":
            base = ceiling
        elif cls == "scores":
            base = ceiling * max(1, len(self.stages))
        elif cls == "dead":
            base = None
        else:  # rollouts, and any stream we do not know: capacity plus what may land after the check
            base = self.stream_capacity + ceiling
        return None if base is None else math.ceil(base * self.queue_headroom)

    def rss_limit(self, service: str) -> int | None:
        if isinstance(self.rss_bytes, dict):
            return self.rss_bytes.get(service, self.rss_bytes.get("*"))  # "*": any service not named
        return self.rss_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "max_staleness": self.max_staleness,
            "stream_capacity": self.stream_capacity,
            "max_steps": self.max_steps,
            "samples_per_step": self.samples_per_step,
            "stages": list(self.stages),
            "trainable": list(self.trainable),
            "admission_window": self.admission_window,
            "in_flight_ceiling": self.in_flight_ceiling,
            "queue_headroom": self.queue_headroom,
            "queue_limits": {c: self.queue_limit(c) for c in STREAM_CLASSES},
            "queue_depth": self.queue_depth,
            "rss_bytes": self.rss_bytes,
            "disk_bytes": self.disk_bytes,
            "max_in_flight": self.max_in_flight,
        }


def resolve_limits(run_dir: Path, limits: dict[str, Any] | None) -> tuple[Limits, list[str]]:
    """Bounds from `RUN_DIR/fleet.yaml` when present, else from `limits`, else RunConfig defaults;
    resource limits only from `limits`. Returns the limits and warnings about where they came from."""
    given = dict(limits or {})
    unknown = sorted(set(given) - LIMIT_KEYS)
    if unknown:
        raise AuditError(f"unknown limits {unknown}; known: {sorted(LIMIT_KEYS)}")
    warnings: list[str] = []
    path = run_dir / "fleet.yaml"
    values: dict[str, Any]
    if path.exists():
        try:
            cfg = load_config(path)
        except ConfigError as err:
            raise AuditError(f"cannot read the run config: {err}") from None
        values = _config_values(cfg)
        source = str(path)
        # The run's own config wins: it is what the controller enforced. Say when a caller's
        # value disagrees, so nobody believes the audit used it.
        for key in CONFIG_KEYS:
            if key in given and _norm(given[key]) != _norm(values[key]):
                warnings.append(f"limits[{key!r}]={given[key]!r} ignored: {path.name} says {values[key]!r}")
    else:
        values = _config_values(RunConfig())
        values["group_size"] = 0  # unknown without the run's config: whole groups are not checked
        from_limits = [k for k in CONFIG_KEYS if k in given]
        values.update({k: given[k] for k in from_limits})
        values["admission_window"] = _window_without_config(values)
        defaulted = [k for k in CONFIG_KEYS if k not in given]
        source = "no fleet.yaml: " + (f"limits for {', '.join(from_limits)}; " if from_limits else "")
        source += f"RunConfig defaults for {', '.join(defaulted)}" if defaulted else "nothing defaulted"
        warnings.append(
            f"{path} not found; bounds come from the limits passed in and RunConfig defaults"
            f" ({', '.join(defaulted) or 'none'} defaulted)"
        )
    values.update({k: given[k] for k in RESOURCE_KEYS if k in given})
    values["stages"] = values["stages"] or ("reward",)
    values["trainable"] = values["trainable"] or ("actor",)
    try:
        return Limits(**values, source=source), warnings
    except ValidationError as err:
        raise AuditError(_bad_limits(err, values)) from None


def _config_values(cfg: RunConfig) -> dict[str, Any]:
    return {
        "max_staleness": cfg.flow.max_staleness,
        "stream_capacity": cfg.flow.stream_capacity,
        "max_steps": cfg.run.max_steps,
        "samples_per_step": cfg.samples_per_step,
        "admission_window": cfg.admission_window,
        "stages": list(cfg.stages()),
        "trainable": ["actor", "critic"] if cfg.algo.needs_critic else ["actor"],
        "group_size": cfg.algo.group_size,
        "dynamic_sampling_tol": cfg.algo.dynamic_sampling_tol,
    }


def _window_without_config(values: dict[str, Any]) -> Any:
    """RunConfig.admission_window's rule, for a run whose config is gone and whose bounds come from
    the caller; values that are not counts are left for `Limits` to refuse by name."""
    ms, sps = values["max_staleness"], values["samples_per_step"]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (ms, sps)):
        return (ms + 1) * sps
    return 0


def _bad_limits(err: ValidationError, values: dict[str, Any]) -> str:
    """One line naming every limit that is wrong, what it must be and what it was."""
    names = dict.fromkeys(str(e["loc"][0]) for e in err.errors() if e["loc"])
    return "; ".join(
        f"limits[{n!r}] must be {_EXPECTED.get(n, 'a non-negative integer')}, got {values.get(n)!r}" for n in names
    )


_EXPECTED = {
    "queue_headroom": "a positive number",
    "queue_depth": "a non-negative integer or a dict stream -> non-negative integer",
    "rss_bytes": "a non-negative integer or a dict service -> non-negative integer",
    "stages": "a list of stage names",
    "trainable": "a list of service names",
}


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple | list) else v
