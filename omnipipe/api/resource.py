"""The whole OmniPipeline resource as read from a file or from the API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnipipe.api import constants as c
from omnipipe.api.pipelines import PIPELINE_TYPES
from omnipipe.api.spec import OmniPipelineSpec

# The longest default stage name decides how long a pipeline name may be: every child
# name <pipeline>-<stage> must stay a 63-character DNS label.
MAX_PIPELINE_NAME = (
    c.MAX_OBJECT_NAME - 1 - max(len(s.name) for p in PIPELINE_TYPES.values() for s in p.stages)
)


class ObjectMeta(BaseModel):
    """The parts of metadata omnipipe reads; the rest passes through."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(pattern=c.DNS_LABEL_PATTERN, max_length=MAX_PIPELINE_NAME)
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = {}


class OmniPipeline(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    api_version: Literal["omnipipe.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["OmniPipeline"]
    metadata: ObjectMeta
    spec: OmniPipelineSpec

    @model_validator(mode="after")
    def _child_names_fit(self) -> OmniPipeline:
        for stage in self.spec.stages:
            child = f"{self.metadata.name}-{stage.name}"
            if len(child) > c.MAX_OBJECT_NAME:
                raise ValueError(
                    f"spec.stages[{stage.name}].name: child name {child!r} is longer "
                    f"than {c.MAX_OBJECT_NAME} characters"
                )
        return self


class ManifestError(ValueError):
    """A pipeline file that cannot be used, with a message naming the problem."""


def parse_resource(body: dict[str, Any]) -> OmniPipeline:
    try:
        return OmniPipeline.model_validate(body)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {where}: {err['msg']}" if where else f"  {err['msg']}")
        raise ManifestError("invalid OmniPipeline:\n" + "\n".join(lines)) from None


def load_file(path: str | Path) -> OmniPipeline:
    """Read an OmniPipeline manifest; the one file serves kubectl and omnipipe serve."""
    p = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
    except OSError as exc:
        raise ManifestError(f"{p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{p}: not valid YAML: {exc}") from None
    pipelines = [d for d in docs if isinstance(d, dict) and d.get("kind") == c.KIND]
    if len(pipelines) != 1:
        raise ManifestError(f"{p}: expected exactly one {c.KIND}, found {len(pipelines)}")
    return parse_resource(pipelines[0])
