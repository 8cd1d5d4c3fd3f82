"""The whole OmniPipeline resource as read from a file or from the API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnipipe.api import constants as c
from omnipipe.api.families import MAX_STAGE_NAME
from omnipipe.api.spec import OmniPipelineSpec
from omnipipe.api.yamlio import RefusedYaml, load_all

# The longest stage name a family may define decides how long a pipeline name may be:
# every child name <pipeline>-<stage> must stay a 63-character DNS label.
MAX_PIPELINE_NAME = c.MAX_OBJECT_NAME - 1 - MAX_STAGE_NAME


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
        for adapter in self.spec.adapters:
            if adapter.name == self.metadata.name:
                raise ValueError(
                    f"spec.adapters[{adapter.name}].name: the pipeline's own name is its "
                    "base model's id; name the adapter otherwise"
                )
        return self


class ManifestError(ValueError):
    """A pipeline file that cannot be used, with a message naming the problem. It never
    quotes the file: a file given by mistake (a key, a log) is not echoed."""


# A ConfigMap holds at most 1 MiB; a pipeline file is a few KiB.
MAX_PIPELINE_FILE_BYTES = 1024 * 1024


def read_pipeline_text(p: Path) -> str:
    """The file's text, refusing what cannot be a pipeline file (too large, not text)."""
    try:
        if p.stat().st_size > MAX_PIPELINE_FILE_BYTES:
            raise ManifestError(
                f"{p}: larger than {MAX_PIPELINE_FILE_BYTES} bytes; not a pipeline file"
            )
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{p}: not a text file; not a pipeline file") from None


def yaml_problem(p: Path, exc: yaml.YAMLError) -> ManifestError:
    """Where the YAML breaks, without the file's text (PyYAML's message quotes it)."""
    if isinstance(exc, RefusedYaml):
        return ManifestError(f"{p}: {exc}")
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ManifestError(f"{p}: not valid YAML{where}")


def validation_lines(exc: ValidationError) -> str:
    """Each error's place and rule, never the value that broke it."""
    lines = []
    for err in exc.errors(include_input=False, include_url=False)[:MAX_ERROR_LINES]:
        where = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {where}: {err['msg']}" if where else f"  {err['msg']}")
    if exc.error_count() > MAX_ERROR_LINES:
        lines.append(f"  ... and {exc.error_count() - MAX_ERROR_LINES} more")
    return "\n".join(lines)


MAX_ERROR_LINES = 20


def parse_resource(body: dict[str, Any]) -> OmniPipeline:
    try:
        return OmniPipeline.model_validate(body)
    except ValidationError as exc:
        raise ManifestError("invalid OmniPipeline:\n" + validation_lines(exc)) from None


def load_file(path: str | Path) -> OmniPipeline:
    """Read an OmniPipeline manifest; the one file serves kubectl and omnipipe serve."""
    p = Path(path)
    text = read_pipeline_text(p)
    try:
        docs = [d for d in load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise yaml_problem(p, exc) from None
    pipelines = [d for d in docs if isinstance(d, dict) and d.get("kind") == c.KIND]
    if len(pipelines) != 1:
        raise ManifestError(f"{p}: expected exactly one {c.KIND}, found {len(pipelines)}")
    try:
        return parse_resource(pipelines[0])
    except ManifestError as exc:
        raise ManifestError(f"{p}: {exc}") from None
