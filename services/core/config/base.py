"""What every config section is built on: the strict base model and the error a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and what is allowed."""


class RunCannotContinue(RuntimeError):
    """Found mid-run, and no restart changes it (the data, the reward or a bound must): the service
    exits 2 and the launcher stops the run on this message instead of restarting into it."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
