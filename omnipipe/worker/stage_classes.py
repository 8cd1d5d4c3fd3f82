"""Which class runs a stage: the table of the pipeline type that the checkpoint's own files
say it is (PipelineType.stage_classes), looked up by the stage's role and engine; the
diffusers fallback's tables (PipelineType.any_diffusers_checkpoint) where the pipeline is
named one of the fallback family's types, or no type claims a diffusers checkpoint. The
classes themselves are the families' (omnipipe.api.families); a family never chooses
them by reading the checkpoint again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnipipe.api import ResolvedPipeline, ResolvedStage
from omnipipe.api.families import (
    Family,
    PipelineType,
    any_diffusers_type,
    family_for_checkpoint,
    installed_families,
    installed_summary,
    load_attribute,
)
from omnipipe.api.from_model import checkpoint_descriptors, is_diffusers_checkpoint

if TYPE_CHECKING:
    from omnipipe.stagekit.stage import Stage


def unimplemented_stages(pipeline: ResolvedPipeline) -> list[str]:
    """Stages no installed family runs, as "name (role on engine)"."""
    runs = frozenset().union(*(f.runs for f in installed_families().values()))
    return [
        f"{s.name} ({s.role.value} on {s.engine.value})"
        for s in pipeline.stages
        if (s.role, s.engine) not in runs
    ]


def checkpoint_type(model_path: str, pipeline: str | None = None) -> tuple[Family, PipelineType]:
    """The installed family and pipeline type whose checkpoints the model's own files say
    it is one of; the catch-all for a diffusers checkpoint when `pipeline` names it, or
    when no other type claims the checkpoint."""
    said = checkpoint_descriptors(model_path)
    kinds = list(said.values())
    catch_all = any_diffusers_type() if is_diffusers_checkpoint(said) else None
    if catch_all is not None:
        # The fallback's types (images, videos, audio, edits) each run with their own table.
        named = (p for p in catch_all[0].pipelines if p.name == pipeline)
        if (kind := next(named, None)) is not None:
            return catch_all[0], kind
    found = family_for_checkpoint(kinds) or catch_all
    if found is None:
        told = ", ".join(kinds) if kinds else "no model_index.json or config.json type"
        raise NotImplementedError(
            f"{model_path}: no installed family runs this checkpoint ({told}); "
            f"installed: {installed_summary()}"
        )
    return found


def stage_class(spec: ResolvedStage, model_path: str, pipeline: str | None = None) -> type[Stage]:
    """The class that runs the stage on this checkpoint, as a stage of `pipeline` (its
    type's name, where known)."""
    family, kind = checkpoint_type(model_path, pipeline)
    reference = kind.stage_classes.get((spec.role, spec.engine))
    if reference is None:
        runs = ", ".join(sorted(f"{r.value} on {e.value}" for r, e in kind.stage_classes))
        raise NotImplementedError(
            f"stage {spec.name}: the {family.name} family runs {runs} on a {kind.name} "
            f"checkpoint ({model_path}), not {spec.role.value} on {spec.engine.value}"
        )
    # Here, not at the top: serve reads unimplemented_stages and should not load torch.
    from omnipipe.stagekit.stage import Stage

    found = load_attribute(reference)
    if not (isinstance(found, type) and issubclass(found, Stage)):
        raise TypeError(f"{reference} (the {family.name} family's) is not a Stage class")
    return found
