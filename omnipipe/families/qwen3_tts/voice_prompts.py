"""An uploaded voice's prompt: what its clip gives a Base model (the x-vector, and the
clip's codes when it was uploaded with its transcript), made once when the voice is
uploaded and kept by the router beside the clip, so that no talker replica encodes the
clip again. JSON, as the router keeps it and the talker is sent it: little-endian float32
and int16 arrays in base64, with the sizes the model that made them had, checked against
the model that reads them (a voice uploaded to another model is refused, not spoken
wrongly)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen3_tts.config import SPECIAL_CODES, TTSConfig
from omnipipe.stagekit.stage import StageInputError

# The router's, for a Base request whose `voice` names an uploaded voice with a prompt.
UPLOADED_PROMPT = "voice_prompt"
FORMAT = 1
CODE_LIMIT = 1 << 15  # int16: the speech tokenizer's codebooks are 2048 wide


def _array(values: torch.Tensor, dtype: str) -> str:
    return base64.b64encode(values.cpu().numpy().astype(dtype).tobytes()).decode()


def prompt_of(x_vector: torch.Tensor, codes: torch.Tensor | None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"format": FORMAT, "x_vector": _array(x_vector.float(), "<f4")}
    if codes is not None:
        if int(codes.max()) >= CODE_LIMIT or int(codes.min()) < 0:
            raise ValueError("a reference code outside int16's range")
        prompt["codes"] = _array(codes, "<i2")
        prompt["frames"] = int(codes.shape[0])
    return prompt


def _refused() -> StageInputError:
    return StageInputError(
        "voice: its prompt was made by another model than this one; upload the voice again",
        "voice",
    )


def _decoded(text: object, dtype: str) -> np.ndarray:
    if not isinstance(text, str):
        raise _refused()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _refused() from None
    if len(raw) % np.dtype(dtype).itemsize:
        raise _refused()
    return np.frombuffer(raw, dtype=dtype)


def read_prompt(
    config: TTSConfig, prompt: object, in_context: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The x-vector (float32) and, in context, the codes (frames x groups, int64) of a
    prompt made by prompt_of, checked against this model's sizes."""
    if not isinstance(prompt, dict) or prompt.get("format") != FORMAT:
        raise _refused()
    x_vector = _decoded(prompt.get("x_vector"), "<f4")
    if len(x_vector) != int(config.speaker_encoder["enc_dim"]) or not np.isfinite(x_vector).all():
        raise _refused()
    if not in_context:
        return torch.from_numpy(x_vector.copy()), None
    if "codes" not in prompt:
        raise StageInputError(
            "voice: it was uploaded without its transcript (ref_text), so it clones from "
            "its x-vector alone: send x_vector_only_mode=true, or upload it with ref_text",
            "voice",
        )
    codes = _decoded(prompt["codes"], "<i2")
    frames = prompt.get("frames")
    if not isinstance(frames, int) or frames < 1 or len(codes) != frames * config.groups:
        raise _refused()
    if int(codes.min()) < 0 or int(codes.max()) >= config.vocab - SPECIAL_CODES:
        raise _refused()
    return (
        torch.from_numpy(x_vector.copy()),
        torch.from_numpy(codes.astype(np.int64).reshape(frames, config.groups)),
    )
