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


def _text(params: dict[str, Any], name: str) -> str | None:
    value = params.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise StageInputError(f"{name}: a string is required", name)
    return value


def voice_of(config: TTSConfig, params: dict[str, Any]) -> Voice:
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
    if not speakers:
        raise StageInputError("voice: this model has no preset voices", "voice")
    asked = _text(params, "voice")
    speaker = speakers[0] if asked is None else asked.lower()
    if speaker not in speakers:
        raise StageInputError(
            f"voice: {speaker[:64]!r} is not one of this model's voices ({', '.join(speakers)})",
            "voice",
        )
    return Voice(speaker, language, instruction)
