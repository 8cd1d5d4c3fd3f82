"""A Qwen3-TTS checkpoint's config.json (model_type qwen3_tts) as the stages need it: its
kind, its voices and languages, the codec's special ids, and transformers configs for
the parts that transformers' own Qwen3 classes hold exactly (docs/design/qwen3-tts.md).

Read as JSON: qwen-tts's config classes do not import on this transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# generate() suppresses the top 1024 ids of the talker's vocabulary (codec specials)
# except the end of speech.
SPECIAL_CODES = 1024
# qwen-tts's defaults where generation_config.json says nothing
# (Qwen3TTSModel._merge_generate_kwargs).
GENERATE_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "subtalker_temperature": 0.9,
    "max_new_tokens": 2048,
}
# Qwen3TTSSpeakerEncoderConfig's defaults: the released Base configs give only enc_dim and
# sample_rate, and qwen-tts fills in the rest from these.
SPEAKER_ENCODER_DEFAULTS: dict[str, Any] = {
    "mel_dim": 128,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
}
KINDS = ("custom_voice", "voice_design", "base")
CHUNK_FRAMES = 25  # talker -> code2wav: 2 s of audio at 12.5 frames a second
# Talker -> code2wav, in the first chunk of an in-context clone: the reference clip's
# codes, decoded ahead of the speech as qwen-tts decodes them, their audio not sent.
PREFIX_CODES = "prefix_codes"


@dataclass(frozen=True)
class TTSConfig:
    kind: str  # custom_voice, voice_design or base
    size: str  # "1b7" or "0b6"
    talker: dict[str, Any]
    predictor: dict[str, Any]
    im_start: int
    im_end: int
    tts_bos: int
    tts_eos: int
    tts_pad: int
    generate: dict[str, Any]
    samples_per_frame: int  # the speech tokenizer's: 1920 at 24 kHz, 12.5 frames a second
    speaker_encoder: dict[str, Any]  # Base's; empty for the other kinds

    @property
    def speakers(self) -> dict[str, int]:
        """Preset voices (CustomVoice), lower case, in the checkpoint's order."""
        return {str(k).lower(): int(v) for k, v in (self.talker.get("spk_id") or {}).items()}

    def dialect(self, speaker: str) -> str | None:
        said = (self.talker.get("spk_is_dialect") or {}).get(speaker)
        return said if isinstance(said, str) and said else None

    @property
    def languages(self) -> dict[str, int]:
        return {str(k).lower(): int(v) for k, v in self.talker["codec_language_id"].items()}

    @property
    def spoken_languages(self) -> list[str]:
        """What a request may name: auto and every language that is not a dialect."""
        return ["auto", *(name for name in self.languages if "dialect" not in name)]

    @property
    def takes_instructions(self) -> bool:
        # qwen-tts drops a CustomVoice instruction when its size is in "0b6" (a substring
        # test: the 0.6B models, and a config that names no size); we refuse it instead.
        return self.kind == "voice_design" or (
            self.kind == "custom_voice" and self.size not in "0b6"
        )

    def code(self, name: str) -> int:
        """One of the codec's special ids: eos, pad, bos, think, nothink, think_bos..."""
        return int(self.talker[f"codec_{name}_id"])

    @property
    def max_positions(self) -> int:
        return int(self.talker["max_position_embeddings"])

    @property
    def eos(self) -> int:
        return int(self.talker["codec_eos_token_id"])

    @property
    def groups(self) -> int:
        return int(self.talker["num_code_groups"])

    @property
    def vocab(self) -> int:
        return int(self.talker["vocab_size"])


def read_config(model_path: str) -> TTSConfig:
    root = Path(model_path)
    doc = json.loads((root / "config.json").read_text())
    kind = doc.get("tts_model_type")
    if kind not in KINDS:
        raise ValueError(f"{root}: tts_model_type {kind!r} is not one of {', '.join(KINDS)}")
    generate = dict(GENERATE_DEFAULTS)
    generation = root / "generation_config.json"
    if generation.is_file():
        said = json.loads(generation.read_text())
        generate.update({k: v for k, v in said.items() if k in GENERATE_DEFAULTS})
    talker = doc["talker_config"]
    codec = json.loads((root / "speech_tokenizer" / "config.json").read_text())
    return TTSConfig(
        kind=kind,
        size=str(doc.get("tts_model_size", "")),
        talker=talker,
        predictor=talker["code_predictor_config"],
        im_start=int(doc["im_start_token_id"]),
        im_end=int(doc["im_end_token_id"]),
        tts_bos=int(doc["tts_bos_token_id"]),
        tts_eos=int(doc["tts_eos_token_id"]),
        tts_pad=int(doc["tts_pad_token_id"]),
        generate=generate,
        samples_per_frame=int(codec["decode_upsample_rate"]),
        speaker_encoder=(
            {**SPEAKER_ENCODER_DEFAULTS, **(doc.get("speaker_encoder_config") or {})}
            if kind == "base"
            else {}
        ),
    )


def qwen3_config(part: dict[str, Any]) -> Any:
    """transformers' dense Qwen3Config for a decoder stack of the checkpoint (the talker's,
    or its code predictor's): the same layers, with 1-D rotary positions (the talker's
    M-RoPE has three equal rows for text, which is plain RoPE)."""
    from transformers import Qwen3Config

    layers = int(part["num_hidden_layers"])
    return Qwen3Config(
        vocab_size=1,  # embeddings are the checkpoint's own (codec and text tables)
        hidden_size=int(part["hidden_size"]),
        intermediate_size=int(part["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(part["num_attention_heads"]),
        num_key_value_heads=int(part["num_key_value_heads"]),
        head_dim=int(part["head_dim"]),
        hidden_act=part.get("hidden_act", "silu"),
        max_position_embeddings=int(part["max_position_embeddings"]),
        rms_norm_eps=float(part["rms_norm_eps"]),
        rope_parameters={"rope_type": "default", "rope_theta": float(part["rope_theta"])},
        attention_bias=bool(part.get("attention_bias", False)),
        layer_types=["full_attention"] * layers,
        use_sliding_window=False,
    )
