"""The OmniPipeline resource: models, pipeline types, resolution and the CRD."""

from omnipipe.api.resolve import ResolvedPipeline, ResolvedStage, resolve
from omnipipe.api.resource import ManifestError, OmniPipeline, load_file, parse_resource

__all__ = [
    "ManifestError",
    "OmniPipeline",
    "ResolvedPipeline",
    "ResolvedStage",
    "load_file",
    "parse_resource",
    "resolve",
]
