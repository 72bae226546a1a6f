"""The base of every config section and the error a config problem raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from async_april.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docstrings are descriptions."""

    # allow_inf_nan=False: no setting is meaningful at inf/NaN (a NaN reward weight or an inf weight decay
    # turns the weights into NaN after one step), so every float field refuses them by name.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False)
