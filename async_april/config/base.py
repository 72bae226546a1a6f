"""The base of every config section and the error a config problem raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from async_april.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
