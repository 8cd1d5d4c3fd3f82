"""Tiny random Qwen3-TTS checkpoints in the released layout, made through qwen-tts 0.1.1's
own classes (run with the side env: /tmp/qtts/ref-venv/bin/python make_tiny.py KIND OUT).

KIND: custom_voice | voice_design | base.  Writes OUT/{config.json, model.safetensors,
generation_config.json, tokenizer files, speech_tokenizer/{config.json, model.safetensors,
preprocessor_config.json}}.

The geometry mirrors the 1.7B release (tts_model_size "1b7": talker hidden != code
predictor hidden, so small_to_mtp_projection exists; text_hidden_size != talker hidden),
with every special codec id at the same offset from the codebook size as in the release
(codebook 2048 -> 64 here; vocab = codebook + 1024; pad 2148 -> 64+100, ...).
"""
import argparse
import json
import math
import os
import sys

import torch

torch.set_num_threads(1)

from tokenizers import AddedToken, Tokenizer, Regex, decoders, models, normalizers, pre_tokenizers
from transformers import EncodecFeatureExtractor, Qwen2TokenizerFast

from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

CODEBOOK = 64                # real 2048
VOCAB = CODEBOOK + 1024      # real 3072: suppress_tokens = range(vocab-1024, vocab) minus EOS
OFF = CODEBOOK - 2048        # real id -> tiny id


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
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>", "<|tts_text_bos_single|>",
)
TEXT_VOCAB = 320             # real text_vocab_size 151936 (> len(tokenizer), padded)


def byte_chars():
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
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
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # specials in a fixed order right after the merged words (real: 151643 endoftext,
    # 151644 im_start, 151645 im_end, ..., 151671 tts_pad, 151672 tts_text_bos, 151673 tts_text_eod)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIALS[1:]),
        errors="replace", clean_up_tokenization_spaces=False, model_max_length=131072,
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    assert len(fast) <= TEXT_VOCAB, len(fast)
    return fast, ids


# ---------------------------------------------------------------- configs
def talker_config(kind, ids, hidden=32, text_hidden=48):
    cp = dict(
        vocab_size=CODEBOOK, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
        max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None,
        num_code_groups=16, layer_types=["full_attention"] * 2, use_sliding_window=False,
        sliding_window=None, max_window_layers=28,
    )
    spk_id, spk_dialect = {}, {}
    if kind == "custom_voice":
        spk_id = {"ryan": real(3061), "vivian": real(3065), "dylan": real(2878)}
        spk_dialect = {"ryan": False, "vivian": False, "dylan": "beijing_dialect"}
    return dict(
        code_predictor_config=cp,
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000,
        rope_scaling={"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default",
                      "type": "default"},
        position_id_per_seconds=13, use_sliding_window=False, sliding_window=None,
        num_code_groups=16, text_hidden_size=text_hidden, text_vocab_size=TEXT_VOCAB,
        codec_eos_token_id=real(2150), codec_think_id=real(2154), codec_nothink_id=real(2155),
        codec_think_bos_id=real(2156), codec_think_eos_id=real(2157),
        codec_pad_id=real(2148), codec_bos_id=real(2149),
        codec_language_id={"chinese": real(2055), "english": real(2050), "german": real(2053),
                           "beijing_dialect": real(2074), "sichuan_dialect": real(2062)},
        spk_id=spk_id, spk_is_dialect=spk_dialect,
    )


def main_config(kind, ids):
    t = talker_config(kind, ids)
    return Qwen3TTSConfig(
        talker_config=t,
        speaker_encoder_config=dict(
            mel_dim=128, enc_dim=t["hidden_size"], enc_channels=[16, 16, 16, 16, 48],
            enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=8, enc_res2net_scale=8, enc_se_channels=8, sample_rate=24000,
        ),
        tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="1b7", tts_model_type=kind,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"], tts_bos_token_id=ids["<|tts_text_bos|>"],
        tts_eos_token_id=ids["<|tts_text_eod|>"],
        architectures=["Qwen3TTSForConditionalGeneration"],
    )


def speech_tokenizer_config(sliding_window):
    enc = dict(  # Mimi, as transformers' MimiConfig (the encoder half is used)
        sampling_rate=24000, frame_rate=12.5, audio_channels=1, hidden_size=32, num_filters=4,
        num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3,
        residual_kernel_size=3, dilation_growth_rate=2, use_causal_conv=True, pad_mode="constant",
        compress=2, trim_right_ratio=1.0, codebook_size=CODEBOOK, codebook_dim=16,
        num_quantizers=32, use_conv_shortcut=False, vector_quantization_hidden_dimension=16,
        num_semantic_quantizers=1, upsample_groups=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, hidden_act="gelu",
        max_position_embeddings=8000, norm_eps=1e-5, use_cache=False, use_streaming=False,
        rope_theta=10000.0, sliding_window=250, layer_scale_initial_scale=0.01,
    )
    dec = dict(
        codebook_size=CODEBOOK, codebook_dim=16, hidden_size=32, head_dim=16, latent_dim=32,
        max_position_embeddings=8000, rope_theta=10000, num_attention_heads=4,
        num_key_value_heads=4, attention_bias=False, sliding_window=sliding_window,
        intermediate_size=64, hidden_act="silu", layer_scale_initial_scale=0.01,
        rms_norm_eps=1e-5, num_hidden_layers=2, num_quantizers=16, num_semantic_quantizers=1,
        semantic_codebook_size=2 * CODEBOOK, vector_quantization_hidden_dimension=16,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
        attention_dropout=0.0,
    )
    return Qwen3TTSTokenizerV2Config(
        encoder_config=enc, decoder_config=dec, encoder_valid_num_quantizers=16,
        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
        encode_downsample_rate=1920, architectures=["Qwen3TTSTokenizerV2Model"],
    )


# ---------------------------------------------------------------- randomisation
@torch.no_grad()
def randomise(model, seed):
    """Every float tensor of the state dict, seeded and in name order, with scales that keep
    activations finite. Parameters that start at zero (biases, codebooks' embedding_sum,
    SnakeBeta alpha/beta) or at constants (norms, LayerScale, ConvNeXt gamma,
    cluster_usage) all get random values, so that no path is silently inert."""
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict(keep_vars=True)
    for name in sorted(sd):
        t = sd[name]
        if not t.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(t.shape)

        def n(scale):
            return torch.randn(shape, generator=g) * scale

        if leaf == "initialized":
            new = torch.ones(shape)
        elif leaf == "cluster_usage":
            new = 0.5 + torch.rand(shape, generator=g)
        elif leaf in ("embedding_sum", "embed_sum"):
            new = n(1.0)
        elif leaf in ("alpha", "beta"):          # SnakeBeta (log-space)
            new = n(0.2)
        elif leaf in ("gamma", "scale"):         # ConvNeXt gamma, LayerScale
            new = 0.1 + n(0.05)
        elif t.dim() == 1 and ("norm" in name or "bn" in name.split(".") or leaf == "weight"):
            # RMSNorm / LayerNorm / BatchNorm weights (and running_var): around 1
            new = (1.0 + n(0.1)) if leaf in ("weight", "running_var") else n(0.1)
            if leaf == "running_var":
                new = new.abs() + 0.5
        elif leaf == "bias" or t.dim() == 1:
            new = n(0.1)
        elif "embedding" in name or "embed_tokens" in name:
            new = n(1.0)
        else:
            fan_in = shape[1] * (math.prod(shape[2:]) if len(shape) > 2 else 1)
            if "ConvTranspose" in type(_module_of(model, name)).__name__:
                fan_in = shape[0] * math.prod(shape[2:]) // max(1, getattr(_module_of(model, name), "stride", (1,))[0])
            new = n(1.0 / math.sqrt(max(1, fan_in)))
        t.copy_(new.to(t.dtype))


@torch.no_grad()
def calibrate_decoder(st, seed, target_std=0.3):
    """Random code2wav weights grow ~3x per decoder block (residual units add), so the
    clamp(-1, 1) would saturate almost every sample and hide differences. Damp the residual
    branches, then scale the last conv so that, on seeded random codes, the pre-clamp
    waveform has std `target_std` (a few % clipped at most)."""
    d = st.decoder
    for name, mod in d.decoder.named_modules():
        if type(mod).__name__ == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit":
            mod.conv2.conv.weight.mul_(0.25)
            mod.conv2.conv.bias.mul_(0.25)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, d.config.codebook_size, (1, d.config.num_quantizers, 40), generator=g)
    h = d.quantizer.decode(codes)
    h = d.pre_conv(h).transpose(1, 2)
    h = d.pre_transformer(inputs_embeds=h).last_hidden_state.permute(0, 2, 1)
    for blocks in d.upsample:
        for b in blocks:
            h = b(h)
    for b in d.decoder[:-1]:
        h = b(h)
    out = d.decoder[-1](h)
    last = d.decoder[-1].conv
    k = target_std / out.std().item()
    last.weight.mul_(k)
    last.bias.mul_(k)
    return k


def _module_of(model, name):
    mod = model
    for part in name.split(".")[:-1]:
        mod = getattr(mod, part)
    return mod


def count(m):
    return sum(p.numel() for p in m.state_dict().values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["custom_voice", "voice_design", "base"])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=None,
                    help="default: 0 custom_voice, 10 voice_design, 20 base (distinct weights)")
    ap.add_argument("--sliding-window", type=int, default=72, help="code2wav window (real 72)")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="generation_config.json max_new_tokens (real 8192)")
    ap.add_argument("--eos-bias", type=float, default=0.0,
                    help="add to codec_head's EOS row norm so greedy decoding stops sooner")
    a = ap.parse_args()
    if a.seed is None:
        a.seed = {"custom_voice": 0, "voice_design": 10, "base": 20}[a.kind]
    os.makedirs(a.out, exist_ok=True)

    tok, ids = make_text_tokenizer(a.out)
    cfg = main_config(a.kind, ids)
    torch.manual_seed(a.seed)
    model = Qwen3TTSForConditionalGeneration(cfg).eval()
    randomise(model, a.seed)
    if a.eos_bias:
        with torch.no_grad():
            eos = cfg.talker_config.codec_eos_token_id
            model.talker.codec_head.weight[eos] *= a.eos_bias
    model.save_pretrained(a.out, safe_serialization=True)
    # Qwen3TTSSpeakerEncoderConfig.__init__ takes no **kwargs (and never calls
    # PretrainedConfig.__init__), yet to_dict() adds "model_type": "" -> the saved config
    # would not load back. The released configs carry only its own keys: keep those.
    cfg_path = os.path.join(a.out, "config.json")
    with open(cfg_path) as f:
        saved = json.load(f)
    import inspect
    allowed = set(inspect.signature(type(cfg.speaker_encoder_config).__init__).parameters) - {"self"}
    saved["speaker_encoder_config"] = {k: v for k, v in saved["speaker_encoder_config"].items()
                                       if k in allowed}
    with open(cfg_path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
    Qwen3TTSProcessor(tokenizer=tok).save_pretrained(a.out)

    gen = dict(do_sample=True, repetition_penalty=1.05, temperature=0.9, top_p=1.0, top_k=50,
               subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_p=1.0,
               subtalker_top_k=50, max_new_tokens=a.max_new_tokens)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)

    st_dir = os.path.join(a.out, "speech_tokenizer")
    st_cfg = speech_tokenizer_config(a.sliding_window)
    torch.manual_seed(a.seed + 1)
    st = Qwen3TTSTokenizerV2Model(st_cfg).eval()
    randomise(st, a.seed + 1)
    calibrate_decoder(st, a.seed + 2)
    st.save_pretrained(st_dir, safe_serialization=True)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_side="right",
                            padding_value=0.0, return_attention_mask=True).save_pretrained(st_dir)

    n_main, n_st = count(model), count(st)
    n_dec, n_enc = count(st.decoder), count(st.encoder)
    print(json.dumps(dict(
        kind=a.kind, out=a.out, text_special_ids=ids, tokenizer_len=len(tok),
        params_main=n_main, params_talker=count(model.talker),
        params_code_predictor=count(model.talker.code_predictor),
        params_speaker_encoder=count(model.speaker_encoder) if model.speaker_encoder is not None else 0,
        params_speech_tokenizer=n_st, params_st_decoder=n_dec, params_st_encoder=n_enc,
        params_total=n_main + n_st,
    ), indent=1))


if __name__ == "__main__":
    main()
