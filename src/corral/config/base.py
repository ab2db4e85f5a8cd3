"""The base of every spec model: unknown fields are errors, and so are `.inf` and `.nan` (no setting means
"never" by infinity; a NaN passes every bound, as no comparison holds)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
