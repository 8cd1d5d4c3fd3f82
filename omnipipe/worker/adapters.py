"""A running worker's LoRA adapters, changed without a restart: PUT /adapters (what
`omnipipe serve` sends on a reload) and the pipeline file the worker was started from
(a Kubernetes ConfigMap volume, which the kubelet updates in place when the operator
writes the resource's new adapters)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from omnipipe.api.adapters import MAX_ADAPTERS, Adapter
from omnipipe.api.loading import new_versions
from omnipipe.worker.runtime import StageRuntime

log = logging.getLogger(__name__)


class AdapterSet(BaseModel):
    """Every adapter the stage should have loaded; the rest are unloaded."""

    adapters: list[Adapter] = Field(max_length=MAX_ADAPTERS)


class AdapterControl:
    """The stage's adapters as loaded, and the one way to change them."""

    def __init__(
        self, stage: str, runtime: Callable[[], StageRuntime | None], loaded: Sequence[Adapter]
    ) -> None:
        self.stage = stage
        self._runtime = runtime
        self.loaded = list(loaded)
        self._lock = asyncio.Lock()

    async def replace(self, adapters: Sequence[Adapter]) -> list[str]:
        if foreign := sorted(a.name for a in adapters if a.stage != self.stage):
            raise ValueError(f"adapters {', '.join(foreign)} are not for stage {self.stage}")
        runtime = self._runtime()
        if runtime is None:
            raise LookupError(f"stage {self.stage} has not loaded its model yet")
        if runtime.stage is None:
            # Asleep (level 2): the wake loads the stage with these.
            async with self._lock:
                self.loaded = list(adapters)
            log.info("stage %s (asleep): LoRA adapters on waking %s", self.stage, len(adapters))
            return sorted(a.name for a in adapters)
        async with self._lock:
            names = await runtime.between_batches(runtime.stage.set_adapters, list(adapters))
            self.loaded = list(adapters)
        log.info("stage %s: LoRA adapters now %s", self.stage, ", ".join(names) or "none")
        return names


def adapters_router(control: AdapterControl) -> APIRouter:
    router = APIRouter()

    @router.get("/adapters")
    async def listed() -> dict[str, object]:
        return {"stage": control.stage, "adapters": sorted(a.name for a in control.loaded)}

    @router.put("/adapters")
    async def replace(body: AdapterSet) -> dict[str, object]:
        try:
            names = await control.replace(body.adapters)
        except LookupError as exc:
            raise HTTPException(503, detail=str(exc)) from None
        except NotImplementedError as exc:
            raise HTTPException(409, detail=f"stage {control.stage}: {exc}") from None
        except Exception as exc:
            raise HTTPException(400, detail=f"adapters not changed: {exc}") from None
        return {"stage": control.stage, "adapters": names}

    return router


async def follow_pipeline_file(path: Path, control: AdapterControl) -> None:
    """Applies the file's adapters for this stage whenever the file changes."""
    async for pipeline in new_versions(path):
        try:
            wanted = pipeline.stage(control.stage).adapters
        except KeyError:
            log.warning("pipeline file %s no longer has stage %s", path, control.stage)
            continue
        if [(a.name, a.source) for a in wanted] == [(a.name, a.source) for a in control.loaded]:
            continue
        try:
            await control.replace(wanted)
        except Exception:
            log.exception("stage %s: the adapters in %s could not be loaded", control.stage, path)
