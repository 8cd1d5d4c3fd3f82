"""The base of every resource model, and the field types several models share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from omnipipe.api import constants as c

DnsLabel = Annotated[str, Field(pattern=c.DNS_LABEL_PATTERN, min_length=1, max_length=63)]
# Kubernetes resource.Quantity: "2", "500m", "16Gi", or a bare integer.
Quantity = Annotated[str, Field(pattern=r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")] | int


class SpecModel(BaseModel):
    """Base for resource models: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )
