"""Tiny random Qwen3-TTS checkpoints in the released layout, made through the model
authors' own classes (qwen-tts 0.1.1): run by the side environment's interpreter
(reference_env.py), never imported by omnipipe.

    python make_tiny.py {custom_voice,voice_design,base} OUT

Writes OUT/{config.json, model.safetensors, generation_config.json, the text tokenizer's
files, speech_tokenizer/{config.json, model.safetensors, preprocessor_config.json}}.

The geometry (tiny_configs.py) mirrors the 1.7B release (tts_model_size "1b7": the
talker's hidden size is not the code predictor's, so small_to_mtp_projection exists;
text_hidden_size differs from both), with every special codec id at the release's offset
from the codebook size (codebook 2048 there, 64 here; vocabulary = codebook + 1024).
"""

import argparse
import inspect
import json
import math
import os

import torch
from qwen_tts.core.models import Qwen3TTSForConditionalGeneration, Qwen3TTSProcessor
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
from tiny_configs import main_config, make_text_tokenizer, speech_tokenizer_config
from transformers import EncodecFeatureExtractor


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

        def n(scale, shape=shape):
            return torch.randn(shape, generator=g) * scale

        if leaf == "initialized":
            new = torch.ones(shape)
        elif leaf == "cluster_usage":
            new = 0.5 + torch.rand(shape, generator=g)
        elif leaf in ("embedding_sum", "embed_sum"):
            new = n(1.0)
        elif leaf in ("alpha", "beta"):  # SnakeBeta (log-space)
            new = n(0.2)
        elif leaf in ("gamma", "scale"):  # ConvNeXt gamma, LayerScale
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
            module = _module_of(model, name)
            if "ConvTranspose" in type(module).__name__:
                stride = max(1, getattr(module, "stride", (1,))[0])
                fan_in = shape[0] * math.prod(shape[2:]) // stride
            new = n(1.0 / math.sqrt(max(1, fan_in)))
        t.copy_(new.to(t.dtype))


@torch.no_grad()
def calibrate_decoder(st, seed, target_std=0.3):
    """Random code2wav weights grow ~3x per decoder block (residual units add), so the
    clamp(-1, 1) would saturate almost every sample and hide differences. Damp the residual
    branches, then scale the last conv so that, on seeded random codes, the pre-clamp
    waveform has std `target_std` (a few % clipped at most)."""
    d = st.decoder
    for _name, mod in d.decoder.named_modules():
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
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["custom_voice", "voice_design", "base"])
    ap.add_argument("out")
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="default: 0 custom_voice, 10 voice_design, 20 base (distinct weights)",
    )
    ap.add_argument("--sliding-window", type=int, default=72, help="code2wav window (real 72)")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="generation_config.json max_new_tokens (real 8192)",
    )
    ap.add_argument(
        "--eos-bias",
        type=float,
        default=0.0,
        help="add to codec_head's EOS row norm so greedy decoding stops sooner",
    )
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

    allowed = set(inspect.signature(type(cfg.speaker_encoder_config).__init__).parameters) - {
        "self"
    }
    saved["speaker_encoder_config"] = {
        k: v for k, v in saved["speaker_encoder_config"].items() if k in allowed
    }
    with open(cfg_path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
    Qwen3TTSProcessor(tokenizer=tok).save_pretrained(a.out)

    gen = dict(
        do_sample=True,
        repetition_penalty=1.05,
        temperature=0.9,
        top_p=1.0,
        top_k=50,
        subtalker_dosample=True,
        subtalker_temperature=0.9,
        subtalker_top_p=1.0,
        subtalker_top_k=50,
        max_new_tokens=a.max_new_tokens,
    )
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)

    st_dir = os.path.join(a.out, "speech_tokenizer")
    st_cfg = speech_tokenizer_config(a.sliding_window)
    torch.manual_seed(a.seed + 1)
    st = Qwen3TTSTokenizerV2Model(st_cfg).eval()
    randomise(st, a.seed + 1)
    calibrate_decoder(st, a.seed + 2)
    st.save_pretrained(st_dir, safe_serialization=True)
    EncodecFeatureExtractor(
        feature_size=1,
        sampling_rate=24000,
        padding_side="right",
        padding_value=0.0,
        return_attention_mask=True,
    ).save_pretrained(st_dir)

    n_main, n_st = count(model), count(st)
    n_dec, n_enc = count(st.decoder), count(st.encoder)
    print(
        json.dumps(
            dict(
                kind=a.kind,
                out=a.out,
                text_special_ids=ids,
                tokenizer_len=len(tok),
                params_main=n_main,
                params_talker=count(model.talker),
                params_code_predictor=count(model.talker.code_predictor),
                params_speaker_encoder=count(model.speaker_encoder)
                if model.speaker_encoder is not None
                else 0,
                params_speech_tokenizer=n_st,
                params_st_decoder=n_dec,
                params_st_encoder=n_enc,
                params_total=n_main + n_st,
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
