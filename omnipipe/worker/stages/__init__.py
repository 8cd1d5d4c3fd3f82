"""Stage implementations: the machinery every family shares lives here; which class runs
a stage is the business of the family whose checkpoint the stage loads
(omnipipe.api.families)."""

from __future__ import annotations

from omnipipe.api import ResolvedPipeline, ResolvedStage
from omnipipe.api.families import (
    Family,
    family_for_checkpoint,
    installed_families,
    installed_summary,
    load_attribute,
)
from omnipipe.api.from_model import checkpoint_kinds
from omnipipe.worker.stages.base import Stage


def unimplemented_stages(pipeline: ResolvedPipeline) -> list[str]:
    """Stages no installed family runs, as "name (role on engine)"."""
    runs = frozenset().union(*(f.runs for f in installed_families().values()))
    return [
        f"{s.name} ({s.role.value} on {s.engine.value})"
        for s in pipeline.stages
        if (s.role, s.engine) not in runs
    ]


def family_for_model(model_path: str) -> Family:
    """The installed family whose checkpoints the model's own files say it is one of."""
    kinds = checkpoint_kinds(model_path)
    found = family_for_checkpoint(kinds)
    if found is None:
        said = ", ".join(kinds) if kinds else "no model_index.json or config.json type"
        raise NotImplementedError(
            f"{model_path}: no installed family runs this checkpoint ({said}); "
            f"installed: {installed_summary()}"
        )
    return found[0]


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    """The class that runs the stage, as the checkpoint's family picks it."""
    family = family_for_model(model_path)
    if (spec.role, spec.engine) not in family.runs:
        runs = ", ".join(sorted(f"{r.value} on {e.value}" for r, e in family.runs))
        raise NotImplementedError(
            f"stage {spec.name}: the {family.name} family ({model_path}) runs {runs}, "
            f"not {spec.role.value} on {spec.engine.value}"
        )
    found: type[Stage] = load_attribute(family.stage_class)(spec, model_path)
    return found
