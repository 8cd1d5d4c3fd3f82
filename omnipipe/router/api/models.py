"""/v1/models: the pipeline, listed whether or not its stages are awake, with the model
of the revision new requests start on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

from omnipipe.api import ResolvedPipeline


def model_ids(pipeline: ResolvedPipeline) -> set[str]:
    """Clients may name the pipeline or the model it serves."""
    return {pipeline.name, pipeline.model}


def models_router(serving: Callable[[], ResolvedPipeline], created: int) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        pipeline = serving()
        return {
            "object": "list",
            "data": [
                {
                    "id": pipeline.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "omnipipe",
                    "root": pipeline.model,
                    "pipeline": pipeline.pipeline,
                }
            ],
        }

    return router
