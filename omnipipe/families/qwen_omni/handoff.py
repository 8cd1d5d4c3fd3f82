"""What a Qwen Omni thinker hands its talker, whichever engine runs it.

A `Handoff` is one model version's half of the thinker-to-talker contract: the talker's
prompt package and one row per fed reply token, built from the hidden states the thinker
computed (transformers' hidden_states tuple, or the layers vLLM's tap captured, keyed the
same way), the thinker's input embedding table and the voices. Each engine's thinker
owns one (qwen25.Qwen25Handoff, qwen3.Qwen3Handoff) around its own forward pass, so both
engines hand the talker the same package from the same layers.

The media layout the talker's rope index reads, and the request's voice, are here too:
both engines' thinkers, talkers and code2wavs read them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from omnipipe.stagekit.stage import StageInputError, Tensors
from omnipipe.stagekit.vllm.tap import FINAL

DEFAULT_VOICE = "Chelsie"
# transformers' hidden_states tuple (0: embeddings, -1: final), or the layers of it that
# another engine captured, keyed the same way.
HiddenStates = tuple[torch.Tensor, ...] | Mapping[int, torch.Tensor]
# The thinker's input embedding table: token ids -> their embeddings.
Embed = Callable[[torch.Tensor], torch.Tensor]

# The processor outputs the talker's rope index reads (see media_layout).
LAYOUT_INPUTS = (
    "image_grid_thw",
    "video_grid_thw",
    "video_second_per_grid",
    "use_audio_in_video",
    "feature_attention_mask",
)


def media_layout(inputs: Tensors) -> Tensors:
    """What the talker's rope index needs of the prompt's media: image and video grids, the
    video's seconds per grid, audio lengths, and whether the video's audio is interleaved."""
    layout: Tensors = {}
    for key in ("image_grid_thw", "video_grid_thw", "video_second_per_grid"):
        if key in inputs:
            layout[key] = inputs[key]
    if "video_grid_thw" in inputs and "use_audio_in_video" in inputs:
        layout["use_audio_in_video"] = inputs["use_audio_in_video"]
    if "feature_attention_mask" in inputs:
        layout["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(-1)
    return layout


def layout_kwargs(layout: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """media_layout as the talker's forward takes it (and the thinker's rope index)."""
    return {
        "image_grid_thw": layout.get("image_grid_thw"),
        "video_grid_thw": layout.get("video_grid_thw"),
        "video_second_per_grid": layout.get("video_second_per_grid"),
        "use_audio_in_video": bool(layout["use_audio_in_video"])
        if "use_audio_in_video" in layout
        else False,
        "audio_feature_lengths": layout.get("audio_feature_lengths"),
    }


def pick_voice(params: dict[str, Any], voices: Sequence[str]) -> str:
    """The request's voice as the checkpoint spells it (names match case-insensitively)."""
    wanted = str(params.get("voice") or DEFAULT_VOICE)
    for name in voices:
        if name.lower() == wanted.lower():
            return name
    raise StageInputError(f"voice {wanted!r} is not available; voices: {', '.join(voices)}")


class Handoff(ABC):
    """One model version's thinker-to-talker hand-off. `config` is the whole omni config,
    `embed` the thinker's input embedding table, `speakers` the checkpoint's speaker map
    (Qwen2.5-Omni's spk_dict.pt; empty where a version keeps its voices in the config)."""

    def __init__(self, config: Any, embed: Embed, speakers: Mapping[str, Any]) -> None:
        self.config = config
        self.embed = embed
        self.speakers = speakers

    @classmethod
    def hidden_layers(cls, config: Any) -> list[int]:
        """The thinker's hidden-state layers the hand-off reads (transformers' numbering):
        what an engine that computes no hidden_states tuple must capture."""
        return [0, FINAL]

    @property
    @abstractmethod
    def voices(self) -> list[str]:
        """The voices the talker can speak in, as the checkpoint spells them."""

    @abstractmethod
    def talker_prompt(self, inputs: Tensors, hidden: HiddenStates, voice: str) -> Tensors:
        """What the talker's prefill needs from the thinker, which owns the embeddings:
        `inputs` holds the prompt's input_ids (and its media layout), `hidden` the
        prompt's states."""

    @abstractmethod
    def reply_row(self, hidden: HiddenStates) -> torch.Tensor:
        """What the talker needs of one fed reply token (the last row of `hidden`)."""
