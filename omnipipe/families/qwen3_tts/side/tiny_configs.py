"""The tiny Qwen3-TTS checkpoints' geometry: the text tokenizer, the model's config and
the speech tokenizer's, through qwen-tts 0.1.1's classes (make_tiny.py builds from
them; run by the side environment's interpreter, never imported by omnipipe)."""

from qwen_tts.core.models import Qwen3TTSConfig
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
    Qwen3TTSTokenizerV2Config,
)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import Qwen2TokenizerFast

CODEBOOK = 64  # real 2048
VOCAB = CODEBOOK + 1024  # real 3072: suppress_tokens = range(vocab-1024, vocab) minus EOS
OFF = CODEBOOK - 2048  # real id -> tiny id


def real(i):
    return i + OFF


# ---------------------------------------------------------------- text tokenizer
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Words whose single-token form the prompt slicing relies on: qwen-tts cuts
# "<|im_start|>assistant\n" as input_id[:, :3] and the tail "<|im_end|>\n<|im_start|>assistant\n"
# as the last 5 ids, so "assistant" (and "user" for instructs) must be one token each.
MERGED_WORDS = ("assistant", "user", "system")
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tts_pad|>",
    "<|tts_text_bos|>",
    "<|tts_text_eod|>",
    "<|tts_text_bos_single|>",
)
TEXT_VOCAB = 320  # real text_vocab_size 151936 (> len(tokenizer), padded)


def byte_chars():
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def make_text_tokenizer(out_dir):
    vocab = {ch: i for i, ch in enumerate(byte_chars())}
    merges = []
    for w in MERGED_WORDS:
        cur = w[0]
        for ch in w[1:]:
            merges.append((cur, ch))
            cur = cur + ch
            if cur not in vocab:
                vocab[cur] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # specials in a fixed order right after the merged words (real: 151643 endoftext,
    # 151644 im_start, 151645 im_end, ..., 151671 tts_pad, 151672 tts_text_bos, 151673 tts_text_eod)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIALS[1:]),
        errors="replace",
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    assert len(fast) <= TEXT_VOCAB, len(fast)
    return fast, ids


# ---------------------------------------------------------------- configs
def talker_config(kind, ids, hidden=32, text_hidden=48):
    cp = dict(
        vocab_size=CODEBOOK,
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        rope_scaling=None,
        num_code_groups=16,
        layer_types=["full_attention"] * 2,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
    )
    spk_id, spk_dialect = {}, {}
    if kind == "custom_voice":
        spk_id = {"ryan": real(3061), "vivian": real(3065), "dylan": real(2878)}
        spk_dialect = {"ryan": False, "vivian": False, "dylan": "beijing_dialect"}
    return dict(
        code_predictor_config=cp,
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        # vLLM's CPU attention needs head_dim >= 32 (the talker on vLLM).
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        rope_scaling={
            "interleaved": True,
            "mrope_section": [8, 4, 4],  # head_dim / 2
            "rope_type": "default",
            "type": "default",
        },
        position_id_per_seconds=13,
        use_sliding_window=False,
        sliding_window=None,
        num_code_groups=16,
        text_hidden_size=text_hidden,
        text_vocab_size=TEXT_VOCAB,
        codec_eos_token_id=real(2150),
        codec_think_id=real(2154),
        codec_nothink_id=real(2155),
        codec_think_bos_id=real(2156),
        codec_think_eos_id=real(2157),
        codec_pad_id=real(2148),
        codec_bos_id=real(2149),
        codec_language_id={
            "chinese": real(2055),
            "english": real(2050),
            "german": real(2053),
            "beijing_dialect": real(2074),
            "sichuan_dialect": real(2062),
        },
        spk_id=spk_id,
        spk_is_dialect=spk_dialect,
    )


def main_config(kind, ids):
    t = talker_config(kind, ids)
    return Qwen3TTSConfig(
        talker_config=t,
        speaker_encoder_config=dict(
            mel_dim=128,
            enc_dim=t["hidden_size"],
            enc_channels=[16, 16, 16, 16, 48],
            enc_kernel_sizes=[5, 3, 3, 3, 1],
            enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=8,
            enc_res2net_scale=8,
            enc_se_channels=8,
            sample_rate=24000,
        ),
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="1b7",
        tts_model_type=kind,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"],
        tts_bos_token_id=ids["<|tts_text_bos|>"],
        tts_eos_token_id=ids["<|tts_text_eod|>"],
        architectures=["Qwen3TTSForConditionalGeneration"],
    )


def speech_tokenizer_config(sliding_window):
    enc = dict(  # Mimi, as transformers' MimiConfig (the encoder half is used)
        sampling_rate=24000,
        frame_rate=12.5,
        audio_channels=1,
        hidden_size=32,
        num_filters=4,
        num_residual_layers=1,
        upsampling_ratios=[8, 6, 5, 4],
        kernel_size=7,
        last_kernel_size=3,
        residual_kernel_size=3,
        dilation_growth_rate=2,
        use_causal_conv=True,
        pad_mode="constant",
        compress=2,
        trim_right_ratio=1.0,
        codebook_size=CODEBOOK,
        codebook_dim=16,
        num_quantizers=32,
        use_conv_shortcut=False,
        vector_quantization_hidden_dimension=16,
        num_semantic_quantizers=1,
        upsample_groups=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="gelu",
        max_position_embeddings=8000,
        norm_eps=1e-5,
        use_cache=False,
        use_streaming=False,
        rope_theta=10000.0,
        sliding_window=250,
        layer_scale_initial_scale=0.01,
    )
    dec = dict(
        codebook_size=CODEBOOK,
        codebook_dim=16,
        hidden_size=32,
        head_dim=16,
        latent_dim=32,
        max_position_embeddings=8000,
        rope_theta=10000,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_bias=False,
        sliding_window=sliding_window,
        intermediate_size=64,
        hidden_act="silu",
        layer_scale_initial_scale=0.01,
        rms_norm_eps=1e-5,
        num_hidden_layers=2,
        num_quantizers=16,
        num_semantic_quantizers=1,
        semantic_codebook_size=2 * CODEBOOK,
        vector_quantization_hidden_dimension=16,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
        decoder_dim=64,
        attention_dropout=0.0,
    )
    return Qwen3TTSTokenizerV2Config(
        encoder_config=enc,
        decoder_config=dec,
        encoder_valid_num_quantizers=16,
        input_sample_rate=24000,
        output_sample_rate=24000,
        decode_upsample_rate=1920,
        encode_downsample_rate=1920,
        architectures=["Qwen3TTSTokenizerV2Model"],
    )
