"""tiny://audioldm: AudioLDM's architecture with tiny random weights, saved as the released
checkpoints are (cvssp/audioldm-s-full-v2: a CLAP text encoder and its RoBERTa tokenizer,
a UNet conditioned on the text embedding as a class embedding, a mel-spectrogram VAE, a
HiFi-GAN vocoder and DDIM), for the fallback's audio tests. It keeps the released timing:
the vocoder turns a 64-bin mel frame into 160 samples at 16 kHz (10 ms a frame) and the
VAE is 4x down with 8 latent channels, so a request's audio_length makes as many latents
and samples as it would on the released model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

# RoBERTa's special tokens, at its ids (CLAP's text model pads with 1 and positions
# count from there); the 256 byte-level characters follow, then <mask>.
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
# The tokens a prompt is padded to: the released tokenizer's 512 would make the tiny
# encoder's work mostly padding.
MAX_TOKENS = 64
TEXT_DIM, PROJECTION_DIM = 32, 16
# As released: 16 kHz, 160 samples a mel frame (5*4*2*2*2), 64 mel bins.
SAMPLING_RATE, UPSAMPLE_RATES, UPSAMPLE_KERNELS, MEL_BINS = (
    16_000,
    (5, 4, 2, 2, 2),
    (16, 16, 8, 4, 4),
    64,
)
# The vocoder's weights' spread: at the default 0.01 its six stacked convolutions make
# ~1e-10 of a waveform, silence in 16-bit PCM; at this its audio peaks near half of full
# scale, unclipped by its closing tanh.
VOCODER_INIT = 0.17
# The UNet's sample size sets the pipeline's default length: 32 latent frames, 4x down,
# 10 ms each, 1.28 s (the released 128 make 5.12 s).
UNET_SAMPLE_SIZE = 32


def save_roberta_byte_tokenizer(directory: Path) -> Any:
    """A byte-level RoBERTa tokenizer with no merges: every byte its own token, the
    released tokenizer's class and special tokens, written offline."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import RobertaTokenizer

    vocab = {token: i for i, token in enumerate(ROBERTA_SPECIALS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    vocab["<mask>"] = len(vocab)
    tokenizer = RobertaTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = MAX_TOKENS
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def build_audioldm(target: Path) -> None:
    """AudioLDMPipeline: CLAP's text embedding -> the UNet (DDIM) -> the VAE's mel
    spectrogram -> the HiFi-GAN vocoder's waveform."""
    import torch
    from diffusers import AudioLDMPipeline, AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import (
        ClapTextConfig,
        ClapTextModelWithProjection,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
    )

    torch.manual_seed(0)
    tokenizer = save_roberta_byte_tokenizer(target / "tokenizer")
    text_encoder = ClapTextModelWithProjection(
        ClapTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            # RoBERTa's positions start after the pad id.
            max_position_embeddings=MAX_TOKENS + 2,
            projection_dim=PROJECTION_DIM,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=UNET_SAMPLE_SIZE,
        in_channels=8,
        out_channels=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=8,
        attention_head_dim=4,
        # No text sequence: its attention attends to its own features, at their width.
        cross_attention_dim=(8, 16),
        # The text embedding enters as a class embedding beside the timestep's, as released.
        class_embed_type="simple_projection",
        projection_class_embeddings_input_dim=PROJECTION_DIM,
        class_embeddings_concat=True,
    )
    vae = AutoencoderKL(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        latent_channels=8,
        norm_num_groups=4,
    )
    vocoder = SpeechT5HifiGan(
        SpeechT5HifiGanConfig(
            model_in_dim=MEL_BINS,
            sampling_rate=SAMPLING_RATE,
            upsample_initial_channel=32,
            upsample_rates=list(UPSAMPLE_RATES),
            upsample_kernel_sizes=list(UPSAMPLE_KERNELS),
            resblock_kernel_sizes=[3, 7],
            resblock_dilation_sizes=[[1, 3], [1, 3]],
            normalize_before=False,
            initializer_range=VOCODER_INIT,
        )
    )
    # The released scheduler: AudioLDM's training betas, DDIM as converted.
    scheduler = DDIMScheduler(
        beta_start=0.0015,
        beta_end=0.0195,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        clip_sample=False,
        set_alpha_to_one=False,
        prediction_type="epsilon",
    )
    pipe = AudioLDMPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        vocoder=vocoder,
    )
    cast(Any, pipe).save_pretrained(str(target))
