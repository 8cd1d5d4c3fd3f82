"""tiny://qwen2.5-omni: Qwen2.5-Omni (thinker, talker, token2wav) with tiny random weights,
its processor (Qwen2-VL image processor, Whisper feature extractor, byte-level tokenizer,
chat template) and a speaker dictionary, saved like the real checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnipipe.stagekit.tokenizer import save_byte_tokenizer

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|tts_pad|>",
    "<|tts_text_bos|>",
    "<|tts_text_eod|>",
    "<|tts_text_bos_single|>",
)
NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
SPEAKERS = ("Chelsie", "Ethan")
# The same structure as Qwen2.5-Omni's template: a system turn, then parts in order.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "You are a tiny random model.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif c['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CODEC_VOCAB = 136  # 128 codes + pad, start, end and mask tokens
MEL_DIM = 20
THINKER_HIDDEN = 64
COND_DIM = 16


def _config(ids: dict[str, int]) -> Any:
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6}
    media = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
    }
    vision_ids = {
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    small = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_parameters": rope,
    }
    return Qwen2_5OmniConfig(
        thinker_config={
            "text_config": {
                **small,
                # vLLM's CPU attention needs head_dim >= 32: 64 / 2 heads.
                "hidden_size": THINKER_HIDDEN,
                "intermediate_size": 2 * THINKER_HIDDEN,
                "rope_parameters": {**rope, "mrope_section": [8, 4, 4]},
                # vLLM ties the output layer to the embeddings when this is true (the
                # default); transformers would use the saved lm_head: keep them apart.
                "tie_word_embeddings": False,
                "vocab_size": 384,
                "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"],
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": THINKER_HIDDEN,
                "fullatt_block_indexes": [0],
                "window_size": 28,
            },
            "audio_config": {
                "encoder_layers": 1,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 16,
                "d_model": 16,
                "output_dim": THINKER_HIDDEN,
            },
            **media,
            # The released checkpoints carry this key; transformers' rope index reads it.
            **vision_ids,
            "user_token_id": ids["<|im_start|>"],
        },
        talker_config={
            **small,
            **media,
            **vision_ids,
            "vocab_size": CODEC_VOCAB,
            "embedding_size": THINKER_HIDDEN,
            # vLLM's CPU attention needs head_dim >= 32 (the vLLM talker); the released
            # talker's head_dim is not hidden_size / heads either (896 / 12 -> 64).
            "head_dim": 32,
            "rope_parameters": {**rope, "mrope_section": [8, 4, 4]},
            "tts_text_start_token_id": ids["<|tts_text_bos|>"],
            "tts_text_end_token_id": ids["<|tts_text_eod|>"],
            "tts_text_pad_token_id": ids["<|tts_pad|>"],
            "tts_codec_pad_token_id": 128,
            "tts_codec_start_token_id": 129,
            "tts_codec_end_token_id": 130,
            "tts_codec_mask_token_id": 132,
        },
        token2wav_config={
            "dit_config": {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "head_dim": 16,
                "emb_dim": 16,
                "num_embeds": CODEC_VOCAB,
                "mel_dim": MEL_DIM,
                "enc_emb_dim": COND_DIM,
                "enc_dim": 16,
                "enc_channels": [16, 16, 16, 16, 48],
                "enc_attention_channels": 8,
                "enc_se_channels": 8,
                "look_ahead_layers": [1],
                "look_backward_layers": [0],
            },
            "bigvgan_config": {
                "mel_dim": MEL_DIM,
                "upsample_initial_channel": 64,
                "resblock_kernel_sizes": [3],
                "resblock_dilation_sizes": [[1, 3, 5]],
            },
        },
    )


def build_qwen25_omni(target: Path) -> None:
    import torch
    from transformers import (
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = save_byte_tokenizer(target / "tokenizer", SPECIAL_TOKENS, NAMED_TOKENS)
    ids = {token: int(str(tokenizer.convert_tokens_to_ids(token))) for token in SPECIAL_TOKENS}
    torch.manual_seed(0)
    model = Qwen2_5OmniForConditionalGeneration(_config(ids))
    # With transformers' default init the tiny vocoder's output is ~1e-8: silence in 16-bit
    # PCM. Wider weights make it audible noise, so chunks and joins can be checked.
    for weight in model.token2wav.code2wav_bigvgan_model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.1)
    # Likewise the talker's attention would be near uniform, blind to its rope positions;
    # sharper queries and keys make a wrong position change its codes.
    for layer in model.talker.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            torch.nn.init.normal_(proj.weight, std=0.5)
    model.save_pretrained(str(target))
    generator = torch.Generator().manual_seed(1)
    speakers = {
        name: {
            "bos_token": ids["<|tts_text_bos_single|>"],
            "cond": torch.randn(1, COND_DIM, generator=generator),
            "ref_mel": torch.randn(1, 30, MEL_DIM, generator=generator),
        }
        for name in SPEAKERS
    }
    torch.save(speakers, target / "spk_dict.pt")
    processor = Qwen2_5OmniProcessor(
        # Small images keep the tiny vision tower fast: at most 4 patches of 28x28.
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56),
        # Video frames likewise: at most 4 patches of 28x28 a frame pair.
        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=56 * 56),
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(target))
