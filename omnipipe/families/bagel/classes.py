"""The stage classes of a BAGEL checkpoint, by role."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Role
from omnipipe.worker.stages.base import Stage


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    from omnipipe.families.bagel.image import BagelDecodeStage, BagelGenerateStage
    from omnipipe.families.bagel.think import BagelThinkStage

    classes: dict[Role, type[Stage]] = {
        Role.THINKER: BagelThinkStage,
        Role.DENOISER: BagelGenerateStage,
        Role.VAE_DECODER: BagelDecodeStage,
    }
    return classes[spec.role]
