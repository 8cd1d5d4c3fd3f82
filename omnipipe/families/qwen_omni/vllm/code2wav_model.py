"""The Qwen Omni code2wav models as vLLM pooling models (imported only inside a vLLM
engine).

vLLM 0.32 has no generation runner for a model that turns a whole prompt into one
output; its pooling runner with the "plugin" task is that (Terratorch uses it for
images). A chunk of talker codes is a request's prompt (Qwen3: each frame's codes in
turn); the model has no attention and no KV cache; its pooler turns every finished
request's codes into audio, the requests of equal length and voice in one forward.
transformers' modules do the math, so the transformers stages stay the reference; a
request's voice, left context and noise seed come in its PoolingParams.extra_kwargs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.pooler import Pooler
from vllm.model_executor.layers.pooler.common import PoolingParamsUpdate
from vllm.model_executor.models.interfaces import IsAttentionFree
from vllm.model_executor.models.interfaces_base import attn_type
from vllm.v1.pool.metadata import PoolingMetadata

from omnipipe.families.qwen_omni.qwen25_token2wav import starting_noise, synthesize

QWEN25_ARCHITECTURE = "OmnipipeQwen25Code2Wav"
QWEN3_ARCHITECTURE = "OmnipipeQwen3Code2Wav"


def load_speakers(model_path: str) -> dict[str, dict[str, Any]]:
    """Qwen2.5-Omni's voices (spk_dict.pt), as transformers' load_speakers reads them."""
    speakers: dict[str, dict[str, Any]] = torch.load(
        Path(model_path) / "spk_dict.pt", weights_only=True
    )
    return speakers


class Job:
    """One request: its codes, the voice, the seed of its noise and its left context."""

    def __init__(self, codes: torch.Tensor, extra: dict[str, Any], default_voice: str) -> None:
        self.codes = codes.long()
        self.extra = extra
        # vLLM's warm-up requests carry no extra_kwargs: any voice does for them.
        self.voice = str(extra.get("voice") or default_voice)

    @property
    def context(self) -> int:
        return int(self.extra.get("context", 0))

    @property
    def seed(self) -> int | None:
        seed = self.extra.get("seed")
        return seed if isinstance(seed, int) else None


class Code2WavPooler(Pooler):
    """Each finished request's codes to the audio of its codes past its left context."""

    def __init__(
        self, synthesize: Callable[[list[Job]], list[torch.Tensor]], default_voice: str
    ) -> None:
        super().__init__()
        # A bound method, not the model: a submodule would make a cycle of modules.
        self.synthesize = synthesize
        self.default_voice = default_voice

    def get_supported_tasks(self) -> Set[Any]:
        return {"plugin"}

    def get_pooling_updates(self, task: Any) -> PoolingParamsUpdate:
        return PoolingParamsUpdate(requires_token_ids=True)

    def forward(
        self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata
    ) -> list[torch.Tensor | None]:
        token_ids = pooling_metadata.prompt_token_ids_cpu
        assert token_ids is not None
        lengths = pooling_metadata.prompt_lens.tolist()
        finished = pooling_metadata.get_pooling_cursor().get_finished_mask()
        jobs = [
            Job(token_ids[i, :length], params.extra_kwargs or {}, self.default_voice)
            for i, (length, params) in enumerate(
                zip(lengths, pooling_metadata.pooling_params, strict=True)
            )
        ]
        out: list[torch.Tensor | None] = [None] * len(jobs)
        batches: dict[tuple[int, str], list[int]] = {}
        for i, job in enumerate(jobs):
            if finished[i]:
                batches.setdefault((len(job.codes), job.voice), []).append(i)
        for indices in batches.values():
            made = self.synthesize([jobs[i] for i in indices])
            for i, audio in zip(indices, made, strict=True):
                out[i] = audio
        return out


@attn_type("attention_free")
class Code2WavModel(nn.Module, IsAttentionFree):
    """What both code2wav models share: no attention, no embedding, the weights under
    `part` in the checkpoint, and a pooler that calls synthesize()."""

    is_pooling_model = True
    part: str  # the checkpoint's prefix of this model's weights, and our module's name

    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The codes are read off the prompt by the pooler; nothing is embedded.
        return torch.empty((input_ids.shape[0], 0), device=input_ids.device)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return torch.zeros((positions.shape[0], 1), device=positions.device)

    def synthesize(self, jobs: list[Job]) -> list[torch.Tensor]:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        module: nn.Module = getattr(self, self.part)
        dtype = next(module.parameters()).dtype
        prefix = self.part + "."
        state = {
            name.removeprefix(prefix): tensor.to(dtype)
            for name, tensor in weights
            if name.startswith(prefix)
        }
        module.load_state_dict(state, strict=True)
        return {prefix + name for name in state}


class Qwen25Code2WavModel(Code2WavModel):
    """Qwen2.5-Omni's token2wav: a DiT sampled from seeded noise, then BigVGAN."""

    part = "token2wav"

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniToken2WavModel,
        )

        model_config = vllm_config.model_config
        config: Any = model_config.hf_config  # the token2wav config (hf_overrides)
        # transformers runs token2wav in float32 only.
        self.token2wav = Qwen2_5OmniToken2WavModel(config).float()
        self.speakers = load_speakers(model_config.model)
        self.num_steps = int(config.omnipipe["num_steps"])
        self.samples_per_code = int(config.omnipipe["samples_per_code"])
        self.pooler = Code2WavPooler(self.synthesize, next(iter(self.speakers)))

    def synthesize(self, jobs: list[Job]) -> list[torch.Tensor]:
        """Jobs of one code length and one voice: one DiT sampling (each job from its
        own seeded noise) and one vocoder pass."""
        device = next(self.token2wav.parameters()).device
        speaker = self.speakers[jobs[0].voice]
        count = len(jobs)
        conditioning = speaker["cond"].to(device).float().repeat(count, 1)
        reference = speaker["ref_mel"].to(device).float().repeat(count, 1, 1)
        codes = torch.stack([j.codes for j in jobs]).to(device)
        dit = self.token2wav.code2wav_dit_model
        noise = torch.cat([starting_noise(dit, len(j.codes), j.seed, device) for j in jobs])
        with torch.inference_mode():
            waves = synthesize(
                self.token2wav, conditioning, reference, codes, noise, self.num_steps
            )
        return [
            w[-(len(j.codes) - j.context) * self.samples_per_code :].float()
            for w, j in zip(waves, jobs, strict=True)
        ]


class Qwen3Code2WavModel(Code2WavModel):
    """Qwen3-Omni's code2wav: a deterministic decoder of frames of num_quantizers codes;
    a request's prompt is its frames' codes, frame after frame."""

    part = "code2wav"

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCode2Wav,
        )

        config: Any = vllm_config.model_config.hf_config  # the code2wav config (hf_overrides)
        self.code2wav = Qwen3OmniMoeCode2Wav(config)
        self.groups = int(config.num_quantizers)
        self.samples_per_frame = int(config.omnipipe["samples_per_frame"])
        self.pooler = Code2WavPooler(self.synthesize, "")

    def synthesize(self, jobs: list[Job]) -> list[torch.Tensor]:
        device = next(self.code2wav.parameters()).device
        # frames x groups each -> batch x groups x frames. A stage's chunk is whole frames;
        # vLLM's warm-ups split a token budget evenly (on a GPU, one token a request), so
        # one may end mid-frame or hold less than a frame: it decodes its whole frames, or
        # one frame of zeros.
        codes = torch.stack([self._frames(j.codes).T for j in jobs]).to(device)
        with torch.inference_mode():
            waves = self.code2wav(codes)
        return [
            w[..., j.context * self.samples_per_frame :].reshape(-1).float()
            for w, j in zip(waves, jobs, strict=True)
        ]

    def _frames(self, codes: torch.Tensor) -> torch.Tensor:
        frames = len(codes) // self.groups
        if frames == 0:
            return codes.new_zeros((1, self.groups))
        return codes[: frames * self.groups].view(frames, self.groups)
