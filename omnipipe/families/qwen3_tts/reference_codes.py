"""A Base checkpoint's reference codes for in-context cloning: a reference clip -> the
12 Hz speech tokenizer's codes for it (frames x 16), which the talker reads after the
reference's transcript and code2wav decodes ahead of the speech (then drops).

The tokenizer's encoder is transformers' Mimi (qwen-tts subclasses MimiModel and drops
its decoder half): the encoder, its transformer, the downsampling and the split
residual quantizer, under speech_tokenizer/model.safetensors' `encoder.*` names. As
qwen-tts encodes one clip: the first encoder_valid_num_quantizers codebooks, and the
frames that cover the clip's samples (ceil(samples / encode_downsample_rate))."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from omnipipe.families.qwen3_tts.code2wav_model import FOLDER

PREFIX = "encoder."


class ReferenceCodes(nn.Module):
    def __init__(self, model_path: str) -> None:
        from transformers import MimiConfig, MimiModel

        super().__init__()
        root = Path(model_path) / FOLDER
        config = json.loads((root / "config.json").read_text())
        self.quantizers = int(config["encoder_valid_num_quantizers"])
        self.downsample = int(config["encode_downsample_rate"])
        mimi_config = MimiConfig(**config["encoder_config"])
        # qwen-tts's transformers (4.57) gives Mimi's encoder a plain causal mask under
        # sdpa and eager attention (its sliding window reaches flash attention alone):
        # the encoder attends over the whole clip, whose 25 Hz positions a minute's clip
        # keeps far below max_position_embeddings.
        mimi_config.sliding_window = mimi_config.max_position_embeddings
        mimi = MimiModel(mimi_config)
        # The decoding half is not in the checkpoint's encoder: it is the decoder's.
        for half in ("upsample", "decoder_transformer", "decoder"):
            setattr(mimi, half, None)
        self.mimi = mimi
        from safetensors.torch import load_file

        weights = {
            name.removeprefix(PREFIX): tensor
            for name, tensor in load_file(str(root / "model.safetensors")).items()
            if name.startswith(PREFIX)
        }
        missing, unexpected = mimi.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{root}: not a Qwen3-TTS speech tokenizer encoder this build reads (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]})"
            )

    def codes(self, waveform: np.ndarray) -> torch.Tensor:
        """A mono float32 clip at 24 kHz -> its codes (frames x quantizers), on the CPU."""
        from transformers.models.mimi.modeling_mimi import MimiEncoderOutput

        device = next(self.parameters()).device
        clip = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))
        with torch.inference_mode():
            encoded = self.mimi.encode(clip.view(1, 1, -1).to(device), return_dict=True)
        assert isinstance(encoded, MimiEncoderOutput)
        assert encoded.audio_codes is not None
        frames = -(-len(waveform) // self.downsample)
        codes: torch.Tensor = encoded.audio_codes[0, : self.quantizers, :frames]
        return codes.T.contiguous().cpu()
