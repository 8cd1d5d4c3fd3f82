"""Qwen2.5-Omni, whichever engine runs it: what its thinker hands the talker
(Qwen25Handoff), its speakers, and its talker's and code2wav's defaults and sizes. The
stages: transformers/ and vllm/."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.qwen_omni.handoff import Handoff, HiddenStates, media_layout
from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import Tensors

# transformers' defaults (Qwen2_5OmniForConditionalGeneration.generate).
TALKER_SAMPLING = Sampling(
    temperature=0.9, top_p=0.8, top_k=40, max_tokens=4096, repetition_penalty=1.05
)
CHUNK_CODES = 25  # talker -> code2wav chunk: half a second of audio at 50 codes/s
CONTEXT_CODES = 25  # left context code2wav decodes again so chunks join smoothly


def samples_per_code(config: Any) -> int:
    """Audio samples one codec code becomes: mel frames per code x vocoder upsampling."""
    t2w = config.token2wav_config
    samples = int(t2w.dit_config.repeats)
    for rate in t2w.bigvgan_config.upsample_rates:
        samples *= int(rate)
    return samples


def read_speakers(model_path: str) -> dict[str, Any]:
    """The checkpoint's speaker map (spk_dict.pt), for an engine that does not load it with
    the model as transformers' from_pretrained does."""
    from transformers.utils.hub import cached_file

    path = cached_file(model_path, "spk_dict.pt")
    if path is None:
        raise FileNotFoundError(f"{model_path}: no spk_dict.pt (the speaker file)")
    speakers: dict[str, Any] = torch.load(path, weights_only=True)
    return speakers


class Qwen25Handoff(Handoff):
    """The talker's prompt is the thinker's final states plus its embeddings (media
    positions zeroed) and the voice's text-bos, text-eos and text-pad embeddings; a reply
    row is the same sum for one token. The voices are the speaker map's."""

    @property
    def voices(self) -> list[str]:
        return list(self.speakers)

    def talker_prompt(self, inputs: Tensors, hidden: HiddenStates, voice: str) -> Tensors:
        config = self.config
        input_ids = inputs["input_ids"]
        embeds = hidden[0].clone()
        media_tokens = (
            config.thinker_config.audio_token_index,
            config.thinker_config.image_token_index,
            config.thinker_config.video_token_index,
        )
        media = torch.isin(input_ids, torch.tensor(media_tokens, device=input_ids.device))
        embeds[media] = 0  # as transformers does: the talker sees no media embeddings
        text_bos = int(self.speakers[voice]["bos_token"])
        specials = torch.tensor(
            [
                [
                    text_bos,
                    config.talker_config.tts_text_end_token_id,
                    config.talker_config.tts_text_pad_token_id,
                ]
            ],
            device=input_ids.device,
        )
        special_embeds = self.embed(specials)[0]
        prompt: Tensors = {
            "prompt_embeds": (hidden[-1] + embeds)[0],
            "input_ids": input_ids[0],
            "text_bos_id": specials[0, :1],
            "text_bos_embed": special_embeds[0],
            "text_eos_embed": special_embeds[1],
            "text_pad_embed": special_embeds[2],
        }
        return {**prompt, **media_layout(inputs)}

    def reply_row(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden[-1][0, -1:] + hidden[0][0, -1:]
