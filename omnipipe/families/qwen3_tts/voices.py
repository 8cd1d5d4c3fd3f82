"""A speech request's voice, language and instructions, checked against what the
checkpoint's kind takes: CustomVoice speaks one of its preset speakers, with an optional
style instruction (not on the 0.6B models); VoiceDesign speaks the voice its
instructions describe; Base clones the voice of a reference clip (`ref_audio`), in context
or from its x-vector alone. VoiceDesign and Base have no presets (`voice`, which OpenAI's
client always sends, is not read)."""

from __future__ import annotations

from typing import Any

from omnipipe.families.qwen3_tts.config import TTSConfig
from omnipipe.families.qwen3_tts.prompt import Voice
from omnipipe.families.qwen3_tts.voice_prompts import UPLOADED_PROMPT, read_prompt
from omnipipe.stagekit.stage import StageInputError

# /v1/audio/speech's task_type, vLLM-Omni's name for a checkpoint's kind: a client may
# say which it expects, and a mismatch is refused rather than spoken otherwise.
TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
CLONING_FIELDS = ("ref_audio", "ref_text", "x_vector_only_mode")
# The router's, for a Base request whose `voice` names an uploaded voice without a prompt
# (UPLOADED_PROMPT): that voice's clip.
UPLOADED_CLIP = "voice_clip"
UPLOADED_TEXT = "voice_ref_text"  # and its transcript, when it was uploaded with one


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
    cloning = [f for f in CLONING_FIELDS if params.get(f) not in (None, "")]
    if config.kind == "base":
        return _cloned(config, params, language, instruction)
    if cloning:
        raise StageInputError(
            f"{cloning[0]}: only a Base model clones a voice; this is a "
            f"{TASK_TYPES[config.kind]} model",
            cloning[0],
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


def _cloned(
    config: TTSConfig, params: dict[str, Any], language: str, instruction: str | None
) -> Voice:
    """Base: the voice of `ref_audio`, or of the uploaded voice `voice` names. As in
    qwen-tts: in context (the clip's codes and `ref_text`, its transcript, in the prompt),
    or from the clip's x-vector alone when x_vector_only_mode is true (`ref_text` is then
    not read). An uploaded voice is cloned in context when it was uploaded with its
    transcript: from its prompt, made when it was uploaded (voice_prompts.py), or from its
    clip when it has none."""
    if instruction is not None:
        raise StageInputError(
            "instructions: a Base model takes none; it speaks the voice of ref_audio",
            "instructions",
        )
    only_x_vector = params.get("x_vector_only_mode")
    if only_x_vector is not None and not isinstance(only_x_vector, bool):
        raise StageInputError("x_vector_only_mode: true or false", "x_vector_only_mode")
    clip = params.get("ref_audio")
    if clip is None or clip == "":
        # An uploaded voice's transcript: it is cloned in context with one.
        text = None if only_x_vector else _text(params, UPLOADED_TEXT)
        prompt = params.get(UPLOADED_PROMPT)
        if prompt is not None:
            x_vector, codes = read_prompt(config, prompt, in_context=text is not None)
            return Voice(
                None, language, None, x_vector=x_vector, reference_text=text, reference_codes=codes
            )
        uploaded = params.get(UPLOADED_CLIP)
        if isinstance(uploaded, str) and uploaded:
            return Voice(None, language, None, reference_clip=uploaded, reference_text=text)
        raise StageInputError(
            "ref_audio: a Base model clones the voice of a reference clip; send one (a WAV "
            "file, base64 or a data: URL), or name a voice uploaded to /v1/audio/voices",
            "ref_audio",
        )
    if not isinstance(clip, str):
        raise StageInputError("ref_audio: a string is required (base64 WAV)", "ref_audio")
    if only_x_vector:
        return Voice(None, language, None, reference_clip=clip)
    text = _text(params, "ref_text")
    if text is None:
        raise StageInputError(
            "ref_text: cloning in context reads the reference clip's transcript; send it, "
            "or x_vector_only_mode=true to clone from the clip's speaker embedding alone",
            "ref_text",
        )
    return Voice(None, language, None, reference_clip=clip, reference_text=text)
