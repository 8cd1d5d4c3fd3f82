"""Step 5, reference half (side env, qwen-tts 0.1.1 on transformers 4.57.3): run the 12 Hz
code2wav decoder, the talker code predictor and the talker's decoder stack on seeded inputs
and dump every stage to /tmp/qtts/cmp/ref.pt, with the weights, for cmp_main.py (transformers
5.19, Qwen3-Omni classes) to compare against.

  /tmp/qtts/ref-venv/bin/python cmp_side.py
"""
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from safetensors.torch import load_file  # noqa: E402
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerConfig  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import (  # noqa: E402
    Qwen3TTSTalkerCodePredictorModelForConditionalGeneration,
)
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration  # noqa: E402
import make_tiny  # noqa: E402

OUT = "/tmp/qtts/cmp"
CKPT = "/tmp/qtts/tiny-custom-voice"
os.makedirs(OUT, exist_ok=True)
dump = {}

# ------------------------------------------------------------------ code2wav decoder
st = Qwen3TTSTokenizerV2Model.from_pretrained(os.path.join(CKPT, "speech_tokenizer")).eval()
d = st.decoder
g = torch.Generator().manual_seed(123)
T = 100  # > sliding window 72
codes = torch.randint(0, d.config.codebook_size, (1, d.config.num_quantizers, T), generator=g)
stages = {}
with torch.no_grad():
    h = d.quantizer.decode(codes); stages["quantizer"] = h
    h = d.pre_conv(h).transpose(1, 2); stages["pre_conv"] = h
    pt = d.pre_transformer
    x = pt.input_proj(h); stages["input_proj"] = x
    inner = {}
    hook = pt.norm.register_forward_hook(lambda m, i, o: inner.__setitem__("norm_out", o))
    h = pt(inputs_embeds=h).last_hidden_state; stages["pre_transformer"] = h
    hook.remove()
    stages["transformer_norm_out"] = inner["norm_out"]
    h = h.permute(0, 2, 1)
    for i, blocks in enumerate(d.upsample):
        for b in blocks:
            h = b(h)
        stages[f"upsample.{i}"] = h
    for i, b in enumerate(d.decoder):
        h = b(h)
        stages[f"decoder.{i}"] = h
    stages["wav"] = d(codes)
    stages["chunked_wav"] = d.chunked_decode(codes)
dump["code2wav"] = dict(
    codes=codes, stages=stages,
    state_dict={k: v.clone() for k, v in d.state_dict().items()},
    config=d.config.to_dict(),
)
print("code2wav stages:", {k: tuple(v.shape) for k, v in stages.items()})

# ------------------------------------------------------------------ code predictor
def cp_run(cp, talker_hidden, tag):
    g = torch.Generator().manual_seed(7)
    emb = torch.randn(1, 2, talker_hidden, generator=g)
    with torch.no_grad():
        pre = cp(inputs_embeds=emb, use_cache=False)
        gen = cp.generate(inputs_embeds=emb, max_new_tokens=cp.config.num_code_groups - 1,
                          do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    dump[tag] = dict(
        inputs_embeds=emb, prefill_logits=pre.logits, sequences=gen.sequences,
        state_dict={k: v.clone() for k, v in cp.state_dict().items()},
        config=cp.config.to_dict(), talker_hidden=talker_hidden,
    )
    print(tag, "sequences", gen.sequences.tolist())

# (a) the tiny checkpoint's code predictor: 1.7B geometry (talker 32 != predictor 24)
sd = load_file(os.path.join(CKPT, "model.safetensors"))
import json
cfg = json.load(open(os.path.join(CKPT, "config.json")))
tcfg = Qwen3TTSTalkerConfig(**cfg["talker_config"])
cp17 = Qwen3TTSTalkerCodePredictorModelForConditionalGeneration(tcfg.code_predictor_config, tcfg).eval()
cp_sd = {k[len("talker.code_predictor."):]: v for k, v in sd.items() if k.startswith("talker.code_predictor.")}
cp17.load_state_dict(cp_sd, strict=True)
cp_run(cp17, tcfg.hidden_size, "cp_1b7")

# (b) 0.6B geometry: predictor hidden == talker hidden (small_to_mtp_projection is Identity)
t06 = dict(cfg["talker_config"])
c06 = dict(t06["code_predictor_config"]); c06["hidden_size"] = t06["hidden_size"]
t06["code_predictor_config"] = c06
tcfg06 = Qwen3TTSTalkerConfig(**t06)
cp06 = Qwen3TTSTalkerCodePredictorModelForConditionalGeneration(tcfg06.code_predictor_config, tcfg06).eval()
make_tiny.randomise(cp06, 99)
cp_run(cp06, tcfg06.hidden_size, "cp_0b6")

# ------------------------------------------------------------------ talker decoder stack
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSTalkerForConditionalGeneration  # noqa: E402
talker = Qwen3TTSTalkerForConditionalGeneration(tcfg).eval()
tk_sd = {k[len("talker."):]: v for k, v in sd.items() if k.startswith("talker.")}
talker.load_state_dict(tk_sd, strict=True)
g = torch.Generator().manual_seed(11)
emb = torch.randn(1, 9, tcfg.hidden_size, generator=g)
mask = torch.ones(1, 9, dtype=torch.long)
with torch.no_grad():
    pos, _ = talker.get_rope_index(mask)
    out = talker.model(inputs_embeds=emb, attention_mask=mask, position_ids=pos, use_cache=False)
    logits = talker.codec_head(out.last_hidden_state)
dump["talker"] = dict(inputs_embeds=emb, position_ids=pos, last_hidden=out.last_hidden_state,
                      logits=logits, state_dict={k: v.clone() for k, v in talker.state_dict().items()},
                      config=tcfg.to_dict())
torch.save(dump, os.path.join(OUT, "ref.pt"))
print("wrote", os.path.join(OUT, "ref.pt"))
