"""Qwen3-Omni-MoE, whichever engine runs it: what its thinker hands the talker
(Qwen3Handoff), its voices, and its talker's, code predictor's and code2wav's defaults
and sizes. The talker's prompt: qwen3_talker_prompt.py; the stages: transformers/ and
vllm/.

Differences from Qwen2.5-Omni that shape the hand-offs:
- The talker projects the thinker's states itself (text_projection, hidden_projection), so
  the thinker sends raw embeddings, plus one mid-layer hidden state for media positions.
- The talker's prompt is the user turns and the first reply token; every later reply token
  is one "trailing text" row, consumed one per codec frame, then tts_eos, then tts_pad.
- A codec frame is num_code_groups codes: the talker picks the first, its code predictor
  the rest. code2wav is causal and deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnipipe.families.qwen_omni.handoff import Handoff, HiddenStates, media_layout
from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import Tensors
from omnipipe.stagekit.vllm.tap import FINAL

# transformers' defaults (Qwen3OmniMoeForConditionalGeneration.generate).
TALKER_SAMPLING = Sampling(
    temperature=0.9, top_p=1.0, top_k=50, max_tokens=4096, repetition_penalty=1.05
)
# The code predictor samples with fixed top-k/top-p, greedy when the talker is greedy.
PREDICTOR_SAMPLING = Sampling(temperature=1.0, top_p=0.8, top_k=50)
CHUNK_FRAMES = 25  # talker -> code2wav chunk: 2 s of audio at 12.5 frames/s
CONTEXT_FRAMES = 25  # as transformers' chunked_decode: left context decoded again
# generate() suppresses the top 1024 ids of the talker's vocabulary (codec specials).
SPECIAL_CODES = 1024


def predictor_sampling(talker: Sampling) -> Sampling:
    """The code predictor's sampling for a talker that samples with `talker`."""
    if talker.temperature == 0:
        return dataclasses.replace(PREDICTOR_SAMPLING, temperature=0.0)
    return PREDICTOR_SAMPLING


def samples_per_frame(config: Any) -> int:
    c2w = config.code2wav_config
    samples = 1
    for rate in (*c2w.upsample_rates, *c2w.upsampling_ratios):
        samples *= int(rate)
    return samples


def voices(config: Any) -> list[str]:
    """Speaker names; the checkpoint keys them in lower case."""
    return [name.capitalize() for name in config.talker_config.speaker_id]


class Qwen3Handoff(Handoff):
    """The talker's prompt is the thinker's embeddings, the state of accept_hidden_layer
    (for media positions) and the tts-bos, tts-eos and tts-pad embeddings; a reply row is
    one token's embedding. Qwen3-Omni keeps its speakers in the config, not in a separate
    file: the speaker map goes unused."""

    @classmethod
    def hidden_layers(cls, config: Any) -> list[int]:
        return [0, int(config.talker_config.accept_hidden_layer), FINAL]

    @property
    def voices(self) -> list[str]:
        return voices(self.config)

    def talker_prompt(self, inputs: Tensors, hidden: HiddenStates, voice: str) -> Tensors:
        config = self.config
        specials = torch.tensor(
            [[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]],
            device=inputs["input_ids"].device,
        )
        prompt: Tensors = {
            "input_ids": inputs["input_ids"][0],
            "prompt_embeds": hidden[0][0],
            "prompt_hidden": hidden[config.talker_config.accept_hidden_layer][0],
            "tts_embeds": self.embed(specials)[0],
            "speaker_id": torch.tensor([config.talker_config.speaker_id[voice.lower()]]),
        }
        return {**prompt, **media_layout(inputs)}

    def reply_row(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden[0][0, -1:]
