"""/v1/models: the pipeline, listed whether or not its stages are awake, with the model
of the revision new requests start on, and each of its LoRA adapters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

from omnipipe.api import ResolvedPipeline


def model_ids(pipeline: ResolvedPipeline) -> set[str]:
    """Clients may name the pipeline, the model it serves, or one of its LoRA adapters."""
    return {pipeline.name, pipeline.model, *(a.name for a in pipeline.adapters)}


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
                },
                # Each adapter is a model of its own, as vLLM lists its LoRAs.
                *(
                    {
                        "id": adapter.name,
                        "object": "model",
                        "created": created,
                        "owned_by": "omnipipe",
                        "root": adapter.source,
                        "parent": pipeline.name,
                        "pipeline": pipeline.pipeline,
                    }
                    for adapter in pipeline.adapters
                ),
            ],
        }

    return router
