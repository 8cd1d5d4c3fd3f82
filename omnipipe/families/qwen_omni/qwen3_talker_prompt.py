"""Qwen3-Omni's talker prompt, as Qwen3OmniMoeForConditionalGeneration.generate builds
it: the user turns' rows (media positions from the thinker's mid-layer state, text from
its embeddings, both projected), then nine assistant rows over the codec prompt. The
transformers talker (transformers/qwen3_talker.py) and the vLLM talker
(vllm/qwen3_talker.py) both use it."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from omnipipe.stagekit.stage import StageInputError, Tensors


def project_text(talker: Any, rows: torch.Tensor) -> torch.Tensor:
    """Thinker embeddings as talker rows (text_projection)."""
    weight = talker.text_projection.linear_fc1.weight
    projected: torch.Tensor = talker.text_projection(rows.to(weight.device, weight.dtype))
    return projected


def _user_part(talker: Any, config: Any, p: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The user turns' rows and ids: media positions from the thinker's mid-layer hidden
    state, text from its embeddings (as _get_talker_user_parts)."""
    ids = p["input_ids"]
    starts = torch.nonzero(ids == config.im_start_token_id).flatten().tolist()
    user = torch.zeros_like(ids, dtype=torch.bool)
    for start, end in zip(starts, [*starts[1:], len(ids)], strict=True):
        if start + 1 < len(ids) and int(ids[start + 1]) == config.user_token_id:
            user[start:end] = True
    media_ids = torch.tensor(
        [
            config.thinker_config.audio_token_id,
            config.thinker_config.image_token_id,
            config.thinker_config.video_token_id,
        ],
        device=ids.device,
    )
    media = torch.isin(ids, media_ids)
    dtype = talker.text_projection.linear_fc1.weight.dtype
    rows = torch.where(
        media[:, None],
        talker.hidden_projection(p["prompt_hidden"].to(dtype)),
        talker.text_projection(p["prompt_embeds"].to(dtype)),
    )
    return rows[user], ids[user]


@dataclasses.dataclass(frozen=True)
class TalkerPrompt:
    """The talker's prompt before the codec embeddings are added: rows (the user turns,
    then nine assistant rows), the codec ids whose embeddings are added to the last six
    rows, the ids the rope index reads, and the assistant's text rows past the four the
    prompt takes (spoken one per frame before the reply's later rows)."""

    rows: torch.Tensor
    codec_ids: torch.Tensor
    talker_ids: torch.Tensor
    ahead: list[torch.Tensor]


def talker_prompt(
    talker: Any, config: Any, p: Tensors, replies: deque[torch.Tensor]
) -> TalkerPrompt:
    """As generate() builds it; takes reply rows from `replies` while the assistant part
    is shorter than four rows."""
    device = p["input_ids"].device
    user_rows, user_ids = _user_part(talker, config, p)
    ids = p["input_ids"]
    assistant = torch.nonzero(
        (ids[:-1] == config.im_start_token_id) & (ids[1:] == config.assistant_token_id)
    ).flatten()
    if not len(assistant):
        raise StageInputError("the thinker's prompt has no assistant turn to answer in")
    # The assistant turn's own tokens, then the reply: its first four rows go into the
    # prompt, the rest are spoken one per frame.
    text = project_text(talker, p["prompt_embeds"][int(assistant[-1]) :])
    while len(text) < 4 and replies:
        text = torch.cat([text, project_text(talker, replies.popleft())])
    if len(text) < 4:
        raise StageInputError("the thinker's assistant turn is shorter than the talker needs")
    tts = project_text(talker, p["tts_embeds"])
    tts_bos, tts_pad = tts[0:1], tts[2:3]
    codec_ids = torch.tensor(
        [
            talker.config.codec_nothink_id,
            talker.config.codec_think_bos_id,
            talker.config.codec_think_eos_id,
            int(p["speaker_id"][0]),
            talker.config.codec_pad_id,
            talker.config.codec_bos_id,
        ],
        device=device,
    )
    return TalkerPrompt(
        rows=torch.cat([user_rows, text[:3], tts_pad.expand(4, -1), tts_bos, text[3:4]]),
        codec_ids=codec_ids,
        talker_ids=torch.cat([user_ids, torch.full((9,), config.tts_pad_token_id, device=device)]),
        ahead=[text[i : i + 1] for i in range(4, len(text))],
    )
