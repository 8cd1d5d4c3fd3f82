"""Read a pipeline file: an OmniPipeline manifest (local mode) or the resolved pipeline
the operator writes into the ConfigMap (in a pod)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
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
from omnipipe.api.yamlio import load

log = logging.getLogger(__name__)


def load_pipeline(path: str | Path) -> ResolvedPipeline:
    p = Path(path)
    text = read_pipeline_text(p)
    try:
        doc = load(text)
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
    if videos := pipeline.videos.as_config():
        data["videos"] = videos["videos"]  # in its place, an unset store left out
    else:
        del data["videos"]
    return yaml.safe_dump(data, sort_keys=False)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    with contextlib.suppress(OSError):
        # stat follows a ConfigMap volume's ..data symlink, which the kubelet swaps.
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns, st.st_size
    return None


async def new_versions(path: Path, every_seconds: float = 2.0) -> AsyncIterator[ResolvedPipeline]:
    """The pipeline file each time it changes (the kubelet's update of the operator's
    ConfigMap); a version that cannot be read is logged and skipped."""
    seen = _stamp(path)
    while True:
        await asyncio.sleep(every_seconds)
        if (stamp := _stamp(path)) == seen:
            continue
        seen = stamp
        try:
            yield await asyncio.to_thread(load_pipeline, path)
        except (ManifestError, OSError) as exc:
            log.warning("pipeline file %s changed but cannot be read: %s", path, exc)
