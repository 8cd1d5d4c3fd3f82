"""tiny://qwen3-omni: Qwen3-Omni-MoE (MoE thinker, MoE talker with its multi-codebook code
predictor, causal code2wav) with tiny random weights, and its processor (Qwen2-VL image
processor at patch 16, Whisper feature extractor, byte-level tokenizer, chat template),
saved like the real checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnipipe.stagekit.tokenizer import save_byte_tokenizer

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    # Single tokens in the real vocabulary, which the talker finds turns by.
    "system",
    "user",
    "assistant",
)
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CODEBOOK = 64  # codes per codebook; the talker's vocabulary adds 1024 special ids after them
CODE_GROUPS = 4  # codebooks per frame: the talker picks the first, the code predictor the rest
THINKER_HIDDEN = 64
SPEAKERS = {"chelsie": CODEBOOK + 6, "ethan": CODEBOOK + 7}


def _config(ids: dict[str, int]) -> Any:
    from transformers import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6}
    moe = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "moe_intermediate_size": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "rope_parameters": rope,
    }
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        # As the released config has it; vLLM's use_audio_in_video reads it.
        "audio_end_token_id": ids["<|audio_end|>"],
    }
    return Qwen3OmniMoeConfig(
        thinker_config={
            "text_config": {
                **moe,
                # vLLM's CPU attention needs head_dim >= 32.
                "hidden_size": THINKER_HIDDEN,
                "head_dim": 32,
                # Interleaved M-RoPE, as the released config says: transformers' thinker
                # always interleaves, vLLM only when told to.
                "rope_parameters": {
                    **rope,
                    "mrope_section": [8, 4, 4],
                    "interleaved": True,
                    "mrope_interleaved": True,
                },
                # vLLM reads it; this transformers config class has no default for it.
                "tie_word_embeddings": False,
                "vocab_size": 384,
                "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"],
            },
            "vision_config": {
                "depth": 2,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": THINKER_HIDDEN,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
                # vLLM's vision tower reads these two; the released config carries them.
                "image_size": 128,
                "apply_vit_abs_pos_embed": True,
            },
            "audio_config": {
                "encoder_layers": 1,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 16,
                "d_model": 16,
                "output_dim": THINKER_HIDDEN,
                "downsample_hidden_size": 8,
            },
            **media,
            "vision_start_token_id": ids["<|vision_start|>"],
            "user_token_id": ids["user"],
        },
        talker_config={
            "text_config": {
                **moe,
                # For the vLLM talker: its CPU attention needs head_dim >= 32, and its
                # CPU MoE kernel widths divisible by 32.
                "head_dim": 32,
                "hidden_size": 32,
                "intermediate_size": 64,
                "moe_intermediate_size": 32,
                "rope_parameters": {**rope, "mrope_section": [8, 4, 4]},
                "vocab_size": CODEBOOK + 1024,
                # Read by the talker's shared expert; the released config carries it too.
                "shared_expert_intermediate_size": 32,
            },
            "code_predictor_config": {
                "vocab_size": CODEBOOK,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "num_code_groups": CODE_GROUPS,
            },
            **media,
            "vision_start_token_id": ids["<|vision_start|>"],
            "num_code_groups": CODE_GROUPS,
            # The talker's rope index reads it; the released config carries it.
            "spatial_merge_size": 2,
            "thinker_hidden_size": THINKER_HIDDEN,
            "accept_hidden_layer": 1,
            "codec_pad_id": CODEBOOK,
            "codec_bos_id": CODEBOOK + 1,
            "codec_eos_token_id": CODEBOOK + 2,
            "codec_nothink_id": CODEBOOK + 3,
            "codec_think_bos_id": CODEBOOK + 4,
            "codec_think_eos_id": CODEBOOK + 5,
            "speaker_id": SPEAKERS,
        },
        code2wav_config={
            "codebook_size": CODEBOOK,
            "hidden_size": 16,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_quantizers": CODE_GROUPS,
            "sliding_window": 8,
            "decoder_dim": 32,
        },
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )


def build_qwen3_omni(target: Path) -> None:
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = save_byte_tokenizer(target / "tokenizer", SPECIAL_TOKENS, NAMED_TOKENS)
    ids = {token: int(str(tokenizer.convert_tokens_to_ids(token))) for token in SPECIAL_TOKENS}
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(_config(ids))
    # With transformers' default init the tiny code2wav's output is ~1e-8: silence in 16-bit
    # PCM. Wider weights make it audible noise, so chunks and joins can be checked.
    for block in (model.code2wav.upsample, model.code2wav.decoder):
        for weight in block.parameters():
            if weight.dim() > 1:
                torch.nn.init.normal_(weight, std=0.1)
    # Likewise the talker's attention would be near uniform, blind to its rope positions;
    # sharper queries and keys make a wrong position change its codes.
    for layer in model.talker.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            torch.nn.init.normal_(proj.weight, std=0.5)
    # Likewise the talker: at the default init its greedy codes repeat one frame whatever
    # the text (the projections of the thinker's states come out at ~1e-4), so tests could
    # not tell a right hand-off from a wrong one.
    for name, weight in model.talker.named_parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.5 if "projection" in name else 0.1)
    model.save_pretrained(str(target))
    processor = Qwen3OmniMoeProcessor(
        # Small images keep the tiny vision tower fast: at most 4 patches of 32x32.
        image_processor=Qwen2VLImageProcessor(
            patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64
        ),
        video_processor=Qwen2VLVideoProcessor(
            patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64
        ),
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(target))
