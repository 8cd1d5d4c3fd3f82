"""Qwen2.5-Omni and Qwen3-Omni (vLLM-Omni's qwen2_5_omni and qwen3_omni_moe): a thinker
that streams text, a talker that streams audio codes, and code2wav that streams audio."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

PACKAGE = "omnipipe.families.qwen_omni"
# Each engine's stages: transformers/ (the reference) and vllm/.
TRANSFORMERS = f"{PACKAGE}.transformers"
VLLM = f"{PACKAGE}.vllm"


def _omni(
    name: str,
    description: str,
    models: tuple[str, ...],
    checkpoint: str,
    stage_classes: dict[tuple[Role, Engine], str],
) -> PipelineType:
    return PipelineType(
        name=name,
        description=description,
        example_models=models,
        checkpoints=(checkpoint,),
        stage_classes=stage_classes,
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
            {
                (Role.THINKER, Engine.TRANSFORMERS): f"{TRANSFORMERS}.thinker:ThinkerStage",
                (Role.TALKER, Engine.TRANSFORMERS): f"{TRANSFORMERS}.qwen25_talker:TalkerStage",
                (Role.CODE2WAV, Engine.TRANSFORMERS): f"{TRANSFORMERS}.code2wav:Code2WavStage",
                (Role.THINKER, Engine.VLLM): f"{VLLM}.thinker:VllmThinkerStage",
                (Role.TALKER, Engine.VLLM): f"{VLLM}.qwen25_talker:VllmTalkerStage",
                (Role.CODE2WAV, Engine.VLLM): f"{VLLM}.code2wav:VllmQwen25Code2WavStage",
            },
        ),
        _omni(
            "qwen3-omni",
            "Qwen3-Omni-MoE: thinker -> talker -> code2wav, streaming.",
            ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "tiny://qwen3-omni"),
            "qwen3_omni_moe",
            {
                (Role.THINKER, Engine.TRANSFORMERS): f"{TRANSFORMERS}.thinker:Qwen3ThinkerStage",
                (Role.TALKER, Engine.TRANSFORMERS): f"{TRANSFORMERS}.qwen3_talker:Qwen3TalkerStage",
                (Role.CODE2WAV, Engine.TRANSFORMERS): f"{TRANSFORMERS}.code2wav:Qwen3Code2WavStage",
                (Role.THINKER, Engine.VLLM): f"{VLLM}.thinker:VllmQwen3ThinkerStage",
                (Role.TALKER, Engine.VLLM): f"{VLLM}.qwen3_talker:VllmQwen3TalkerStage",
                (Role.CODE2WAV, Engine.VLLM): f"{VLLM}.code2wav:VllmQwen3Code2WavStage",
            },
        ),
    ),
    tiny_models={
        "qwen2.5-omni": f"{PACKAGE}.tiny.qwen25:build_qwen25_omni",
        "qwen3-omni": f"{PACKAGE}.tiny.qwen3:build_qwen3_omni",
        "qwen2.5-omni-lora": f"{PACKAGE}.tiny.qwen25_thinker_lora:build_thinker_lora",
    },
)
