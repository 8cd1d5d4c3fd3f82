"""Qwen2.5-Omni and Qwen3-Omni (vLLM-Omni's qwen2_5_omni and qwen3_omni_moe): a thinker
that streams text, a talker that streams audio codes, and code2wav that streams audio."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role


def _omni(name: str, description: str, models: tuple[str, ...], checkpoint: str) -> PipelineType:
    return PipelineType(
        name=name,
        description=description,
        example_models=models,
        checkpoints=(checkpoint,),
        stages=(
            StageDefaults("thinker", Role.THINKER, Engine.VLLM),
            StageDefaults("talker", Role.TALKER, Engine.TRANSFORMERS, inputs=("thinker",)),
            StageDefaults("code2wav", Role.CODE2WAV, Engine.TRANSFORMERS, inputs=("talker",)),
        ),
    )


FAMILY = Family(
    name="qwen-omni",
    description="Qwen2.5-Omni and Qwen3-Omni: text, images, audio, video in; text, speech out.",
    pipelines=(
        _omni(
            "qwen2.5-omni",
            "Any to text and speech: thinker -> talker -> code2wav, streaming.",
            ("Qwen/Qwen2.5-Omni-7B", "tiny://qwen2.5-omni"),
            "qwen2_5_omni",
        ),
        _omni(
            "qwen3-omni",
            "Qwen3-Omni-MoE: thinker -> talker -> code2wav, streaming.",
            ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "tiny://qwen3-omni"),
            "qwen3_omni_moe",
        ),
    ),
    runs=frozenset(
        {
            (Role.THINKER, Engine.TRANSFORMERS),
            (Role.THINKER, Engine.VLLM),
            (Role.TALKER, Engine.TRANSFORMERS),
            (Role.TALKER, Engine.VLLM),
            (Role.CODE2WAV, Engine.TRANSFORMERS),
            (Role.CODE2WAV, Engine.VLLM),
        }
    ),
    stage_class="omnipipe.families.qwen_omni.classes:stage_class",
    tiny_models={
        "qwen2.5-omni": "omnipipe.families.qwen_omni.tiny:build_qwen25_omni",
        "qwen3-omni": "omnipipe.families.qwen_omni.tiny_qwen3:build_qwen3_omni",
        "qwen2.5-omni-lora": "omnipipe.families.qwen_omni.tiny_lora:build_thinker_lora",
    },
)
