"""Which class runs a stage: the table of the pipeline type that the checkpoint's own files
say it is (PipelineType.stage_classes), looked up by the stage's role and engine. The
classes themselves are the families' (omnipipe.api.families); a family never chooses
them by reading the checkpoint again."""

from __future__ import annotations

from omnipipe.api import ResolvedPipeline, ResolvedStage
from omnipipe.api.families import (
    Family,
    PipelineType,
    family_for_checkpoint,
    installed_families,
    installed_summary,
    load_attribute,
)
from omnipipe.api.from_model import checkpoint_kinds
from omnipipe.stagekit.stage import Stage


def unimplemented_stages(pipeline: ResolvedPipeline) -> list[str]:
    """Stages no installed family runs, as "name (role on engine)"."""
    runs = frozenset().union(*(f.runs for f in installed_families().values()))
    return [
        f"{s.name} ({s.role.value} on {s.engine.value})"
        for s in pipeline.stages
        if (s.role, s.engine) not in runs
    ]


def checkpoint_type(model_path: str) -> tuple[Family, PipelineType]:
    """The installed family and pipeline type whose checkpoints the model's own files say
    it is one of."""
    kinds = checkpoint_kinds(model_path)
    found = family_for_checkpoint(kinds)
    if found is None:
        said = ", ".join(kinds) if kinds else "no model_index.json or config.json type"
        raise NotImplementedError(
            f"{model_path}: no installed family runs this checkpoint ({said}); "
            f"installed: {installed_summary()}"
        )
    return found


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    """The class that runs the stage on this checkpoint."""
    family, kind = checkpoint_type(model_path)
    reference = kind.stage_classes.get((spec.role, spec.engine))
    if reference is None:
        runs = ", ".join(sorted(f"{r.value} on {e.value}" for r, e in kind.stage_classes))
        raise NotImplementedError(
            f"stage {spec.name}: the {family.name} family runs {runs} on a {kind.name} "
            f"checkpoint ({model_path}), not {spec.role.value} on {spec.engine.value}"
        )
    found = load_attribute(reference)
    if not (isinstance(found, type) and issubclass(found, Stage)):
        raise TypeError(f"{reference} (the {family.name} family's) is not a Stage class")
    return found
