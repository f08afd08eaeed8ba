"""The base every spec model shares and the field types more than one of them uses.

Every model reads camelCase keys as the CRD writes them (snake_case too), is frozen, and ignores fields it
does not know (spec.py's `unknown_fields` names them): a newer CRD may add fields an older operator must
keep serving.
"""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

DNSName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]
Quantity = Annotated[str | int, Field(union_mode="left_to_right")]


class SpecModel(BaseModel):
    """A part of the spec: camelCase keys (snake_case accepted), frozen, unknown fields ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)
