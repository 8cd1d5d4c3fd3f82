"""The talker's prompt for one request, as qwen-tts's generate() builds it: an optional
instruction turn, the assistant role, the codec's think/language/speaker tags over tts
pads, then the text in one of qwen-tts's two ways:
- whole (non_streaming_mode, the default of generate_custom_voice and
  generate_voice_design): every text token over codec pads, then tts_pad over codec bos;
  each step after the prompt adds tts_pad to its frame;
- a token a step (streaming, generate_voice_clone's default): the first text token over
  codec bos ends the prompt, and each step adds the next text row to its frame (the rest
  of the text, then tts_eos), then tts_pad once the text is used up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnipipe.families.qwen3_tts.config import TTSConfig
from omnipipe.families.qwen3_tts.talker_model import TalkerModel
from omnipipe.stagekit.stage import StageInputError


@dataclass(frozen=True)
class Voice:
    """What a request asks the talker to speak with: a preset speaker (CustomVoice) or a
    reference clip's x-vector (Base), a language (or auto) and an instruction (a style,
    or VoiceDesign's description). `reference_clip` is the clip as sent (base64 WAV), until
    the talker has made its x-vector."""

    speaker: str | None
    language: str
    instruction: str | None
    reference_clip: str | None = field(default=None, compare=False)
    x_vector: torch.Tensor | None = field(default=None, compare=False)
    # In-context cloning (Base): the clip's transcript, and its codes (frames x groups)
    # once the talker has encoded the clip; None for cloning from the x-vector alone.
    reference_text: str | None = None
    reference_codes: torch.Tensor | None = field(default=None, compare=False)


# The assistant turn's template around the text, in tokens: "<|im_start|>assistant\n"
# before it, "<|im_end|>\n<|im_start|>assistant\n" after (qwen-tts slices [3:-5]).
TEMPLATE_TOKENS = 3 + 5


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_text(text: str) -> str:
    """The reference clip's transcript as qwen-tts tokenizes it (it slices [3:-2])."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


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


@dataclass(frozen=True)
class Prompt:
    """The rows the talker is prefilled with, and what each step after them adds to the
    frame it feeds back."""

    rows: torch.Tensor  # (1 x n x hidden)
    trailing: torch.Tensor  # (1 x k x hidden): what step i adds to its frame, i < k
    tts_pad: torch.Tensor  # (1 x 1 x hidden): what each later step adds

    def step_row(self, step: int) -> torch.Tensor:
        """What the step that feeds frame `step` (from 0) adds to it."""
        return self.trailing[:, step : step + 1] if step < self.trailing.shape[1] else self.tts_pad


def prompt_embeds(
    model: TalkerModel,
    config: TTSConfig,
    text_ids: torch.Tensor,
    instruction_ids: torch.Tensor | None,
    voice: Voice,
    streaming_text: bool = False,
    reference_ids: torch.Tensor | None = None,
) -> Prompt:
    """text_ids: the assistant turn's ids (1 x m), role and tail included;
    reference_ids: the reference transcript's (reference_text()), for in-context cloning
    with voice.reference_codes."""
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
    elif voice.x_vector is not None:  # a cloned voice sits where a preset speaker would
        codec.append(voice.x_vector.to(device).view(1, 1, -1))
    codec.append(model.codec_rows(ids([config.code("pad"), config.code("bos")])))
    codec_rows = torch.cat(codec, dim=1)
    role = model.text_rows(text_ids[:, :3])
    tagged = (
        torch.cat((tts_pad.expand(-1, codec_rows.shape[1] - 2, -1), tts_bos), dim=1)
        + codec_rows[:, :-1]
    )
    words = text_ids[:, 3:-5]
    start = model.codec_rows(ids([config.code("bos")]))
    if voice.reference_codes is not None and reference_ids is not None:
        rows, trailing = in_context_rows(
            model, reference_ids[:, 3:-2], words, voice.reference_codes, tts_eos, tts_pad, start
        )
        parts = [role, tagged, rows]
    elif streaming_text:
        parts = [role, tagged, model.text_rows(words[:, :1]) + start]
        trailing = torch.cat((model.text_rows(words[:, 1:]), tts_eos), dim=1)
    else:
        spoken = torch.cat((model.text_rows(words), tts_eos), dim=1) + model.codec_rows(
            ids([config.code("pad")] * (words.shape[1] + 1))
        )
        parts = [role, tagged, spoken, tts_pad + start]
        trailing = tts_pad[:, :0]
    if instruction_ids is not None:
        parts.insert(0, model.text_rows(instruction_ids))
    return Prompt(torch.cat(parts, dim=1), trailing, tts_pad)


def in_context_rows(
    model: TalkerModel,
    reference_words: torch.Tensor,
    words: torch.Tensor,
    codes: torch.Tensor,
    tts_eos: torch.Tensor,
    tts_pad: torch.Tensor,
    start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qwen-tts's in-context prompt, text streamed in (generate_voice_clone's default): the
    transcript's and the text's rows (then tts_eos) laid over codec bos and the clip's
    frames, row for row; the text's rows past the frames are what the steps add, and when
    the frames outnumber the rows, the rows run on as tts_pad."""
    text = torch.cat((model.text_rows(torch.cat((reference_words, words), dim=1)), tts_eos), dim=1)
    codec = torch.cat((start, model.reference_rows(codes.to(start.device))), dim=1)
    frames = codec.shape[1]
    if text.shape[1] > frames:
        return text[:, :frames] + codec, text[:, frames:]
    padded = torch.cat([text] + [tts_pad] * (frames - text.shape[1]), dim=1)
    return padded + codec, tts_pad[:, :0]
