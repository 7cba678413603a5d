"""Config section for experiment trackers (`run.trackers`): where every metrics row also goes,
besides RUN_DIR/metrics.jsonl (the source of truth) and Prometheus. Each entry is optional and
names its library; `services.core.observability.trackers` checks at start-up that the library is installed."""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from services.core.config.base import Strict


def _absolute(path: str | None) -> str | None:
    # Services may start in another directory than the launcher: pinned at parse time, as other paths.
    return None if path is None else os.path.abspath(os.path.expanduser(path))


class _Tracker(Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TensorBoardSpec(_Tracker):
    kind: Literal["tensorboard"]
    """TensorBoard event files, written through `torch.utils.tensorboard` (pip extra `track`)."""
    dir: str | None = None
    """Log directory (`tensorboard --logdir` it); None: RUN_DIR/tensorboard."""

    @field_validator("dir")
    @classmethod
    def _dir_absolute(cls, v: str | None) -> str | None:
        return _absolute(v)


class WandbSpec(_Tracker):
    kind: Literal["wandb"]
    """Weights & Biases (pip extra `track`)."""
    project: Annotated[str, Field(min_length=1, max_length=128)] = "rlfleet"
    """W&B project the run goes to."""
    entity: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    """W&B entity (user or team); None: the account's default."""
    mode: Literal["offline", "online"] = "offline"
    """offline: the run stays in `dir` (upload later with `wandb sync`); online: streamed to the
    server, which needs WANDB_API_KEY in the environment (checked at start-up)."""
    dir: str | None = None
    """Directory W&B writes its `wandb/` folder into; None: RUN_DIR."""

    @field_validator("dir")
    @classmethod
    def _dir_absolute(cls, v: str | None) -> str | None:
        return _absolute(v)


class MlflowSpec(_Tracker):
    kind: Literal["mlflow"]
    """MLflow, through `mlflow-skinny` (pip extra `track`)."""
    tracking_uri: Annotated[str, Field(min_length=1)] | None = None
    """MLflow tracking URI: `file:PATH` for a local file store, or a tracking server's URL;
    None: file:RUN_DIR/mlruns."""
    experiment: Annotated[str, Field(min_length=1, max_length=256)] = "rlfleet"
    """Experiment the run is created in (created when missing)."""

    @field_validator("tracking_uri")
    @classmethod
    def _file_uri_absolute(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("file:") and not v.startswith("file://"):
            return "file:" + str(_absolute(v[len("file:"):]))
        return v


TrackerSpec = Annotated[TensorBoardSpec | WandbSpec | MlflowSpec, Field(discriminator="kind")]
TRACKER_KINDS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow")
