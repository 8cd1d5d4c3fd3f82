"""Qwen3-TTS (the model authors' qwen-tts): text to speech with preset voices and style
instructions (CustomVoice), a voice described in words (VoiceDesign) or the voice of a
reference clip (Base, in context or from its speaker embedding). A talker that
makes 16-code frames (its code predictor inside it) streams them to code2wav, the 12 Hz
speech tokenizer's decoder."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

PACKAGE = "omnipipe.families.qwen3_tts"

FAMILY = Family(
    name="qwen3-tts",
    description="Qwen3-TTS text to speech: preset, designed and cloned voices (qwen-tts).",
    pipelines=(
        PipelineType(
            name="qwen3-tts",
            description=(
                "Text to speech: talker (16-code frames, its code predictor inside) -> "
                "code2wav, streaming."
            ),
            example_models=(
                "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
                "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign",
                "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
                "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
                "tiny://qwen3-tts-custom-voice",
            ),
            checkpoints=("qwen3_tts",),
            stages=(
                # The faster engine under load (bench/tts.py, docs/speech.md): vLLM's
                # continuous batch steps every request's talker at once.
                StageDefaults("talker", Role.TALKER, Engine.VLLM),
                StageDefaults("code2wav", Role.CODE2WAV, Engine.TRANSFORMERS, inputs=("talker",)),
            ),
            stage_classes={
                (Role.TALKER, Engine.TRANSFORMERS): f"{PACKAGE}.talker:TalkerStage",
                (Role.TALKER, Engine.VLLM): f"{PACKAGE}.vllm.talker:VllmTalkerStage",
                (Role.CODE2WAV, Engine.TRANSFORMERS): f"{PACKAGE}.code2wav:Code2WavStage",
            },
            speech_fields=frozenset(
                {
                    "instructions",
                    "language",
                    "task_type",
                    "initial_codec_chunk_frames",
                    "ref_audio",
                    "ref_text",
                    "x_vector_only_mode",
                }
            ),
        ),
    ),
    tiny_models={
        "qwen3-tts-custom-voice": f"{PACKAGE}.tiny:build_custom_voice",
        "qwen3-tts-voice-design": f"{PACKAGE}.tiny:build_voice_design",
        "qwen3-tts-base": f"{PACKAGE}.tiny:build_base",
    },
)
