"""A pipeline's revision: a stable hash of what one stage hands the next.

Two replicas may serve parts of the same request only when they agree on the model,
the engines, the stage graph and the transfer backend, and on every engine argument
(dtype, lengths, ...), since each shapes the tensors a stage sends downstream. Replicas,
autoscaling, sampling defaults, resources, environment and placement do not change those
tensors: they roll in place. A change of revision rolls out as a whole new set of stage
workloads beside the old one (see docs/architecture.md, "Revisions").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from omnipipe.api.resolve import ResolvedPipeline

REVISION_CHARS: Final = 10


def compatibility_fields(pipeline: ResolvedPipeline) -> dict[str, Any]:
    """Everything the revision depends on, and nothing else."""
    return {
        "model": pipeline.model,
        "pipeline": pipeline.pipeline,
        "transfer": pipeline.transfer.backend.value,
        "stages": [
            {
                "name": s.name,
                "role": s.role.value,
                "engine": s.engine.value,
                "model": s.model,
                "inputs": list(s.inputs),
                "engine_args": s.engine_args,
            }
            for s in pipeline.stages
        ],
    }


def pipeline_revision(pipeline: ResolvedPipeline) -> str:
    """Lowercase hex, REVISION_CHARS long: fits a label value and a name suffix."""
    raw = json.dumps(
        compatibility_fields(pipeline), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:REVISION_CHARS]
