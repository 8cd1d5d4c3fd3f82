"""The stage classes of a Qwen2.5-Omni or Qwen3-Omni checkpoint, by role and engine: the
checkpoint's model type, not the pipeline type's name, says which it is."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Engine, Role
from omnipipe.families.qwen_omni.engine import QWEN3_OMNI, omni_model_type
from omnipipe.worker.stages.base import Stage


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    if spec.engine is Engine.VLLM and spec.role is Role.TALKER:
        if omni_model_type(model_path) == QWEN3_OMNI:
            from omnipipe.families.qwen_omni.vllm_qwen3_talker import VllmQwen3TalkerStage

            return VllmQwen3TalkerStage
        from omnipipe.families.qwen_omni.vllm_qwen25_talker import VllmTalkerStage

        return VllmTalkerStage
    if spec.engine is Engine.VLLM and spec.role is Role.CODE2WAV:
        from omnipipe.families.qwen_omni import vllm_code2wav

        if omni_model_type(model_path) == QWEN3_OMNI:
            return vllm_code2wav.VllmQwen3Code2WavStage
        return vllm_code2wav.VllmQwen25Code2WavStage
    if spec.engine is Engine.VLLM:
        from omnipipe.families.qwen_omni.vllm_thinker import vllm_thinker_class

        return vllm_thinker_class(model_path)
    from omnipipe.families.qwen_omni import qwen3, qwen25, thinker

    if omni_model_type(model_path) == QWEN3_OMNI:
        return {
            Role.THINKER: qwen3.Qwen3ThinkerStage,
            Role.TALKER: qwen3.Qwen3TalkerStage,
            Role.CODE2WAV: qwen3.Qwen3Code2WavStage,
        }[spec.role]
    return {
        Role.THINKER: thinker.ThinkerStage,
        Role.TALKER: qwen25.TalkerStage,
        Role.CODE2WAV: qwen25.Code2WavStage,
    }[spec.role]
