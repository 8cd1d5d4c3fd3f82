"""Read a pipeline file: an OmniPipeline manifest (local mode) or the resolved pipeline
the operator writes into the ConfigMap (in a pod)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from omnipipe.api import constants as c
from omnipipe.api.resolve import ResolvedPipeline, resolve
from omnipipe.api.resource import ManifestError, load_file


def load_pipeline(path: str | Path) -> ResolvedPipeline:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ManifestError(f"{p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{p}: not valid YAML: {exc}") from None
    if isinstance(doc, dict) and doc.get("kind") == c.KIND:
        return resolve(load_file(p))
    try:
        return ResolvedPipeline.model_validate(doc)
    except ValidationError as exc:
        raise ManifestError(f"{p}: neither an {c.KIND} nor a resolved pipeline: {exc}") from None


def pipeline_yaml(pipeline: ResolvedPipeline) -> str:
    """The resolved pipeline as a file that load_pipeline reads back unchanged: what the
    operator's ConfigMap holds and what `omnipipe serve` hands each revision's workers."""
    return yaml.safe_dump(pipeline.model_dump(mode="json"), sort_keys=False)
