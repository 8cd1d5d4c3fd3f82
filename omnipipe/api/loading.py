"""Read a pipeline file: an OmniPipeline manifest (local mode) or the resolved pipeline
the operator writes into the ConfigMap (in a pod)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from omnipipe.api import constants as c
from omnipipe.api.resolve import ResolvedPipeline, resolve
from omnipipe.api.resource import (
    ManifestError,
    load_file,
    read_pipeline_text,
    validation_lines,
    yaml_problem,
)


def load_pipeline(path: str | Path) -> ResolvedPipeline:
    p = Path(path)
    text = read_pipeline_text(p)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise yaml_problem(p, exc) from None
    if isinstance(doc, dict) and doc.get("kind") == c.KIND:
        return resolve(load_file(p))
    neither = f"{p}: neither an {c.KIND} manifest nor a resolved pipeline"
    if not isinstance(doc, dict):
        raise ManifestError(f"{neither} (it holds no YAML mapping)")
    try:
        return ResolvedPipeline.model_validate(doc)
    except ValidationError as exc:
        raise ManifestError(f"{neither}:\n{validation_lines(exc)}") from None


def pipeline_yaml(pipeline: ResolvedPipeline) -> str:
    """The resolved pipeline as a file that load_pipeline reads back unchanged: what the
    operator's ConfigMap holds and what `omnipipe serve` hands each revision's workers."""
    data = pipeline.model_dump(mode="json")
    if not pipeline.tracing.as_config():
        del data["tracing"]
    return yaml.safe_dump(data, sort_keys=False)
