"""A reload's LoRA adapter changes, sent to the running workers of each stage whose set
changed (PUT /adapters), instead of replacing those workers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from omnipipe.api import ResolvedPipeline
from omnipipe.api.adapters import Adapter
from omnipipe.local import control
from omnipipe.local.children import Child


def push_adapters(
    changes: Mapping[str, Sequence[Adapter]], workers: Iterable[Child], credential: str
) -> str:
    """Every worker of each changed stage loads its new set; "" when all did, else what
    went wrong first."""
    workers = list(workers)
    for stage, adapters in changes.items():
        wanted = [a.model_dump(mode="json") for a in adapters]
        for child in (c for c in workers if c.runs(stage)):
            if problem := control.put_adapters(child.stage_url(stage), wanted, credential):
                return f"{child.name} could not change its adapters: {problem}"
        names = ", ".join(a.name for a in adapters) or "none"
        print(f"omnipipe: {stage}: LoRA adapters now {names}", flush=True)
    return ""


def restore_adapters(
    stages: Iterable[str], serving: ResolvedPipeline, workers: Iterable[Child], credential: str
) -> None:
    """Best effort, after a failed push: back to the sets the serving pipeline names."""
    workers = list(workers)
    for stage in stages:
        old = [a.model_dump(mode="json") for a in serving.stage(stage).adapters]
        for child in (c for c in workers if c.runs(stage)):
            control.put_adapters(child.stage_url(stage), old, credential)
