"""Step 5, project half (transformers 5.19, /work/main/.venv/bin/python): do transformers'
Qwen3-Omni classes (Qwen3OmniMoeCode2Wav*, Qwen3OmniMoeTalkerCodePredictor*) and the dense
Qwen3Model have qwen-tts's architecture and parameter names? Loads /tmp/qtts/cmp/ref.pt
(written by cmp_side.py under qwen-tts 0.1.1 / transformers 4.57.3) and compares module
trees, state-dict keys/shapes, and outputs on the same weights and inputs.
"""
import math
import re

import torch
import transformers
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as om
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
    Qwen3OmniMoeTalkerCodePredictorConfig,
)
from transformers import Qwen3Config, Qwen3Model

torch.set_num_threads(1)
ref = torch.load("/tmp/qtts/cmp/ref.pt", weights_only=False)
print("transformers", transformers.__version__)


def maxdiff(a, b):
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return f"{(a - b).abs().max().item():.3g}"


def pat(k):
    return re.sub(r"\.(\d+)(?=\.|$)", ".{N}", k)


def key_diff(name, ref_sd, om_sd):
    rk, ok = set(ref_sd), set(om_sd)
    both = sorted(rk & ok)
    shape_mis = [k for k in both if tuple(ref_sd[k].shape) != tuple(om_sd[k].shape)]
    only_ref = sorted({pat(k) for k in rk - ok})
    only_om = sorted({pat(k) for k in ok - rk})
    print(f"\n== {name}: {len(both)} keys in both ({len(shape_mis)} with different shapes), "
          f"{len(rk - ok)} only in qwen-tts, {len(ok - rk)} only in transformers")
    for p in only_ref:
        print(f"   only qwen-tts:      {p}")
    for p in only_om:
        print(f"   only transformers:  {p}")
    for k in shape_mis:
        print(f"   shape differs:      {k}: qwen-tts {list(ref_sd[k].shape)} vs transformers {list(om_sd[k].shape)}")


# ====================================================================== code2wav
c2w = ref["code2wav"]
dc = c2w["config"]
print("\nqwen-tts decoder config:", {k: dc[k] for k in ("codebook_size", "codebook_dim", "hidden_size", "head_dim",
      "latent_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size", "num_hidden_layers",
      "sliding_window", "decoder_dim", "upsample_rates", "upsampling_ratios", "num_quantizers", "rope_theta")})
ocfg = Qwen3OmniMoeCode2WavConfig(
    codebook_size=dc["codebook_size"], hidden_size=dc["hidden_size"], head_dim=dc["head_dim"],
    max_position_embeddings=dc["max_position_embeddings"],
    rope_parameters={"rope_type": "default", "rope_theta": dc["rope_theta"]},
    num_attention_heads=dc["num_attention_heads"], num_key_value_heads=dc["num_key_value_heads"],
    attention_bias=dc["attention_bias"], sliding_window=dc["sliding_window"],
    intermediate_size=dc["intermediate_size"], hidden_act=dc["hidden_act"],
    layer_scale_initial_scale=dc["layer_scale_initial_scale"], rms_norm_eps=dc["rms_norm_eps"],
    num_hidden_layers=dc["num_hidden_layers"], num_quantizers=dc["num_quantizers"],
    upsample_rates=list(dc["upsample_rates"]), upsampling_ratios=list(dc["upsampling_ratios"]),
    decoder_dim=dc["decoder_dim"],
)
print("omni code2wav config keeps head_dim:", getattr(ocfg, "head_dim", None))
# NB: Qwen3OmniMoeCode2Wav runs upsample/decoder at hidden_size; qwen-tts at latent_dim.
# The tiny checkpoint has hidden_size == latent_dim (32), so one Code2Wav can hold both here.
assert dc["hidden_size"] == dc["latent_dim"]
omc = om.Qwen3OmniMoeCode2Wav(ocfg).eval()
ref_sd = c2w["state_dict"]
key_diff("code2wav: qwen-tts Qwen3TTSTokenizerV2Decoder vs Qwen3OmniMoeCode2Wav", ref_sd, omc.state_dict())
common = {k: v for k, v in ref_sd.items() if k in omc.state_dict() and omc.state_dict()[k].shape == v.shape}
missing, unexpected = omc.load_state_dict(common, strict=False)
print("   loaded common keys; left at init in Omni:", sorted({pat(k) for k in missing}))

st = c2w["stages"]
with torch.no_grad():
    # transformer core: qwen-tts input_proj output -> layers + norm
    tr = omc.pre_transformer(inputs_embeds=st["input_proj"]).last_hidden_state
    print("\n-- pre_transformer layers+norm (Omni Code2WavTransformerModel, T=100 > window 72):",
          "max|diff| =", maxdiff(tr, st["transformer_norm_out"]))
    h = st["pre_transformer"].permute(0, 2, 1)
    for i, blocks in enumerate(omc.upsample):
        for b in blocks:
            h = b(h)
        print(f"-- upsample.{i} (k == stride, no trimming difference):", maxdiff(h, st[f"upsample.{i}"]))
    h = st["upsample.1"]
    for i, b in enumerate(omc.decoder):
        h_in = st["upsample.1"] if i == 0 else st[f"decoder.{i-1}"]
        h = b(h_in)
        print(f"-- decoder.{i} {type(b).__name__} from qwen-tts's own input:", maxdiff(h, st[f"decoder.{i}"]))

    # the CausalTransConvNet difference: Omni trims ceil(k-s) from BOTH ends, qwen-tts trims
    # k-s from the right only. Patch the Omni modules to trim like qwen-tts and re-run.
    n = 0
    for m in omc.modules():
        if isinstance(m, om.Qwen3OmniMoeCausalTransConvNet):
            pad = m.conv.kernel_size[0] - m.conv.stride[0]
            m.left_pad, m.right_pad = 0, pad
            n += 1
    print(f"\n   patched {n} Qwen3OmniMoeCausalTransConvNet to left_pad=0, right_pad=k-s (qwen-tts)")
    for i, b in enumerate(omc.decoder):
        h_in = st["upsample.1"] if i == 0 else st[f"decoder.{i-1}"]
        print(f"-- patched decoder.{i}:", maxdiff(b(h_in), st[f"decoder.{i}"]))
    # whole back half (pre_transformer core -> wav), fed qwen-tts's front (quantizer, pre_conv,
    # input_proj) output, then output_proj applied by hand
    W, B = ref_sd["pre_transformer.output_proj.weight"], ref_sd["pre_transformer.output_proj.bias"]
    h = omc.pre_transformer(inputs_embeds=st["input_proj"]).last_hidden_state
    h = torch.nn.functional.linear(h, W, B).permute(0, 2, 1)
    for blocks in omc.upsample:
        for b in blocks:
            h = b(h)
    for b in omc.decoder:
        h = b(h)
    print("-- patched back half -> wav (clamped):", maxdiff(h.clamp(-1, 1), st["wav"]))

# ====================================================================== code predictor
for tag in ("cp_0b6", "cp_1b7"):
    r = ref[tag]
    c = r["config"]
    pcfg = Qwen3OmniMoeTalkerCodePredictorConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], hidden_act=c["hidden_act"],
        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        attention_bias=c["attention_bias"], layer_types=c["layer_types"], num_code_groups=c["num_code_groups"],
    )
    ocp = om.Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(pcfg).eval()
    sd = r["state_dict"]
    key_diff(f"{tag}: qwen-tts Qwen3TTSTalkerCodePredictorModelForConditionalGeneration vs "
             f"Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration "
             f"(talker hidden {r['talker_hidden']}, predictor hidden {c['hidden_size']})", sd, ocp.state_dict())
    emb = r["inputs_embeds"]
    load = {k: v for k, v in sd.items() if k in ocp.state_dict() and ocp.state_dict()[k].shape == v.shape}
    if "small_to_mtp_projection.weight" in sd:
        W, B = sd["small_to_mtp_projection.weight"], sd["small_to_mtp_projection.bias"]
        # fold the projection into the predictor's own embedding tables; project the prefill
        for i in range(c["num_code_groups"] - 1):
            load[f"model.codec_embedding.{i}.weight"] = torch.nn.functional.linear(
                sd[f"model.codec_embedding.{i}.weight"], W, B)
        emb = torch.nn.functional.linear(emb, W, B)
        print("   (small_to_mtp_projection folded into codec_embedding.{i} and applied to the prefill)")
    missing, unexpected = ocp.load_state_dict(load, strict=True), None
    with torch.no_grad():
        pre = ocp(inputs_embeds=emb, use_cache=False)
        gen = ocp.generate(inputs_embeds=emb, max_new_tokens=c["num_code_groups"] - 1, do_sample=False,
                           return_dict_in_generate=True)
    print(f"-- {tag} prefill logits max|diff|:", maxdiff(pre.logits, r["prefill_logits"]))
    print(f"-- {tag} greedy 15 codes equal:", torch.equal(gen.sequences, r["sequences"]),
          gen.sequences.tolist(), "vs", r["sequences"].tolist())

# ====================================================================== talker stack vs dense Qwen3Model
r = ref["talker"]
c = r["config"]
qcfg = Qwen3Config(
    vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
    num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
    num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], hidden_act=c["hidden_act"],
    max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
    rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]}, attention_bias=False,
    tie_word_embeddings=False,
)
qm = Qwen3Model(qcfg).eval()
tsd = {k[len("model."):]: v for k, v in r["state_dict"].items() if k.startswith("model.")}
key_diff("talker.model (qwen-tts Qwen3TTSTalkerModel) vs transformers Qwen3Model", tsd, qm.state_dict())
load = {k: v for k, v in tsd.items() if k in qm.state_dict()}
load["embed_tokens.weight"] = tsd["codec_embedding.weight"]
qm.load_state_dict(load, strict=True)
with torch.no_grad():
    out = qm(inputs_embeds=r["inputs_embeds"], position_ids=r["position_ids"][0], use_cache=False)
print("-- talker stack (interleaved M-RoPE, 3 equal rows) vs Qwen3Model 1-D RoPE, last hidden max|diff|:",
      maxdiff(out.last_hidden_state, r["last_hidden"]))
