"""The diffusers fallback's stages as its unit tests make them: the spec of its one stage
for a pipeline type, the stage class that type runs on a tiny checkpoint, and a call
cancelled at its first step."""

from __future__ import annotations

from typing import Any, TypeVar

from omnipipe.api import parse_resource, resolve
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import Stage, StageJob, StageResult
from omnipipe.worker.stage_classes import stage_class

S = TypeVar("S", bound=Stage)


def fallback_spec(model: str, pipeline: str) -> Any:
    """The resolved spec of the fallback's one stage, for `model` served as `pipeline`."""
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "fallback"},
                "spec": {"model": model, "pipeline": pipeline},
            }
        )
    ).stage("pipeline")


def fallback_stage(model: str, pipeline: str, kind: type[S]) -> S:
    """The stage (not loaded) that `pipeline` runs on `model`: of class `kind`."""
    spec, path = fallback_spec(model, pipeline), resolve_model_path(model)
    made = stage_class(spec, path, pipeline)(spec, path, "cpu")
    assert isinstance(made, kind)
    return made


def cancelled_at_first_step(
    stage: Stage, params: dict[str, Any]
) -> tuple[StageResult, list[tuple[int, int]]]:
    """The result of a call of one request cancelled at its first step, and the steps it
    reported, (step, of steps)."""
    job = StageJob(params, {})
    steps: list[tuple[int, int]] = []

    def cancel_at_first(step: int, total: int) -> None:
        steps.append((step, total))
        job.cancelled.set()

    job.on_step = cancel_at_first
    [result] = stage.run_batch([job])
    return result, steps
