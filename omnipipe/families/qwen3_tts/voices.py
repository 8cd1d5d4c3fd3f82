"""A speech request's voice, language and instructions, checked against what the
checkpoint's kind takes: CustomVoice speaks one of its preset speakers, with an optional
style instruction (not on the 0.6B models); VoiceDesign speaks the voice its
instructions describe, and has no presets (`voice`, which OpenAI's client always sends,
is not read)."""

from __future__ import annotations

from typing import Any

from omnipipe.families.qwen3_tts.config import TTSConfig
from omnipipe.families.qwen3_tts.prompt import Voice
from omnipipe.stagekit.stage import StageInputError

# /v1/audio/speech's task_type, vLLM-Omni's name for a checkpoint's kind: a client may
# say which it expects, and a mismatch is refused rather than spoken otherwise.
TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}


def _text(params: dict[str, Any], name: str) -> str | None:
    """A text field, None when absent or empty (as qwen-tts treats "": a blank one it
    reads as given)."""
    value = params.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise StageInputError(f"{name}: a string is required", name)
    return value


def voice_of(config: TTSConfig, params: dict[str, Any]) -> Voice:
    task = _text(params, "task_type")
    if task is not None and task != TASK_TYPES[config.kind]:
        raise StageInputError(
            f"task_type: this is a {TASK_TYPES[config.kind]} model, not {task[:64]!r}",
            "task_type",
        )
    language = (_text(params, "language") or "auto").lower()
    if language not in config.spoken_languages:
        raise StageInputError(
            f"language: {language[:64]!r} is not one this model speaks "
            f"({', '.join(config.spoken_languages)})",
            "language",
        )
    instruction = _text(params, "instructions")
    if instruction is not None and not config.takes_instructions:
        raise StageInputError(
            "instructions: this model takes none (Qwen3-TTS 0.6B CustomVoice)", "instructions"
        )
    if config.kind == "voice_design":
        if instruction is None:
            raise StageInputError(
                "instructions: a VoiceDesign model speaks the voice its instructions "
                "describe; describe one",
                "instructions",
            )
        return Voice(None, language, instruction)
    speakers = list(config.speakers)
    asked = _text(params, "voice")
    if not speakers or asked is None:
        raise StageInputError(
            f"voice: one of this model's voices is required ({', '.join(speakers)})"
            if speakers
            else "voice: this model has no preset voices",
            "voice",
        )
    speaker = asked.lower()
    if speaker not in speakers:
        raise StageInputError(
            f"voice: {speaker[:64]!r} is not one of this model's voices ({', '.join(speakers)})",
            "voice",
        )
    return Voice(speaker, language, instruction)
