"""The talker's prompt for one request, as qwen-tts's generate() builds it with the whole
text given up front (non_streaming_mode, its generate_* functions' default): an optional
instruction turn, the assistant role, the codec's think/language/speaker tags over tts
pads, every text token over codec pads, then tts_pad over codec bos. The text rows are
all in the prompt, so every step after it adds tts_pad to its frame."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnipipe.families.qwen3_tts.config import TTSConfig
from omnipipe.families.qwen3_tts.talker_model import TalkerModel
from omnipipe.stagekit.stage import StageInputError


@dataclass(frozen=True)
class Voice:
    """What a request asks the talker to speak with: a preset speaker (CustomVoice), a
    language (or auto) and an instruction (a style, or VoiceDesign's description)."""

    speaker: str | None
    language: str
    instruction: str | None


# The assistant turn's template around the text, in tokens: "<|im_start|>assistant\n"
# before it, "<|im_end|>\n<|im_start|>assistant\n" after (qwen-tts slices [3:-5]).
TEMPLATE_TOKENS = 3 + 5


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruction_text(instruction: str) -> str:
    return f"<|im_start|>user\n{instruction}<|im_end|>\n"


def language_code(config: TTSConfig, voice: Voice) -> int | None:
    """The codec's language tag: none for auto, and a dialect speaker's own dialect
    when it speaks Chinese or auto."""
    code = None if voice.language == "auto" else config.languages[voice.language]
    if voice.speaker and voice.language in ("chinese", "auto"):
        dialect = config.dialect(voice.speaker)
        if dialect is not None:
            code = config.languages[dialect]
    return code


def prompt_embeds(
    model: TalkerModel,
    config: TTSConfig,
    text_ids: torch.Tensor,
    instruction_ids: torch.Tensor | None,
    voice: Voice,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 x n x hidden) prompt and the (1 x 1 x hidden) tts_pad row each step adds.
    text_ids: the assistant turn's ids (1 x m), role and tail included."""
    device = text_ids.device

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor([values], device=device, dtype=text_ids.dtype)

    if text_ids.shape[1] <= TEMPLATE_TOKENS:
        raise StageInputError("input: nothing to speak", "input")
    tts_bos, tts_eos, tts_pad = model.text_rows(
        ids([config.tts_bos, config.tts_eos, config.tts_pad])
    ).chunk(3, dim=1)
    language = language_code(config, voice)
    tags = [config.code("think"), config.code("think_bos")]
    tags = (
        [config.code("nothink"), config.code("think_bos"), config.code("think_eos")]
        if language is None
        else [*tags, language, config.code("think_eos")]
    )
    codec = [model.codec_rows(ids(tags))]
    if voice.speaker is not None:
        speaker = torch.tensor(config.speakers[voice.speaker], device=device)
        codec.append(model.codec_rows(speaker).view(1, 1, -1))
    codec.append(model.codec_rows(ids([config.code("pad"), config.code("bos")])))
    codec_rows = torch.cat(codec, dim=1)
    role = model.text_rows(text_ids[:, :3])
    tagged = (
        torch.cat((tts_pad.expand(-1, codec_rows.shape[1] - 2, -1), tts_bos), dim=1)
        + codec_rows[:, :-1]
    )
    words = text_ids[:, 3:-5]
    spoken = torch.cat((model.text_rows(words), tts_eos), dim=1) + model.codec_rows(
        ids([config.code("pad")] * (words.shape[1] + 1))
    )
    start = tts_pad + model.codec_rows(ids([config.code("bos")]))
    parts = [role, tagged, spoken, start]
    if instruction_ids is not None:
        parts.insert(0, model.text_rows(instruction_ids))
    return torch.cat(parts, dim=1), tts_pad
