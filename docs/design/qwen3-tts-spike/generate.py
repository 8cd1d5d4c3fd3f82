"""Run qwen-tts 0.1.1 (official) on a tiny checkpoint on the CPU, greedy and seeded-sampled,
twice each, and record shapes / frames / EOS / timings / determinism.

  /tmp/qtts/ref-venv/bin/python generate.py CKPT [--max-new-tokens N] [--out DIR]

The kind (custom_voice / voice_design / base) is read from CKPT/config.json.
Codes and waveforms are saved to OUT/<kind>-<mode>.npz for later equality tests.
"""
import argparse
import json
import os
import time

import numpy as np
import torch

torch.set_num_threads(1)

from qwen_tts import Qwen3TTSModel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="defaults to generation_config.json's max_new_tokens")
    ap.add_argument("--text", default="Hello world, this is a test.")
    ap.add_argument("--out", default="/tmp/qtts/out")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    t0 = time.perf_counter()
    tts = Qwen3TTSModel.from_pretrained(a.ckpt, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    model = tts.model
    kind = model.tts_model_type
    print(f"[{kind}] loaded in {load_s:.2f}s; attn={model.config._attn_implementation}; "
          f"speakers={sorted(tts.get_supported_speakers() or [])}; "
          f"languages={tts.get_supported_languages()}; generate_config={model.generate_config}")

    # the prompt's token structure (the model slices [:3] and [-5:])
    ids = tts._tokenize_texts([tts._build_assistant_text(a.text)])[0][0].tolist()
    print(f"[{kind}] prompt ids ({len(ids)}): head={ids[:3]} tail={ids[-5:]}")

    # capture codes and the raw talker length through the wrappers
    captured = {}
    orig_generate = model.generate
    orig_talker_generate = model.talker.generate

    def gen_wrap(*args, **kw):
        codes, hid = orig_generate(*args, **kw)
        captured["codes"] = [c.clone() for c in codes]
        captured["kw"] = {k: v for k, v in kw.items() if not isinstance(v, (list, dict, torch.Tensor))}
        return codes, hid

    def talker_wrap(*args, **kw):
        r = orig_talker_generate(*args, **kw)
        captured["talker_steps"] = len(r.hidden_states)
        captured["talker_seq"] = r.sequences.clone()
        return r

    model.generate = gen_wrap
    model.talker.generate = talker_wrap

    eos = model.config.talker_config.codec_eos_token_id
    mnt = a.max_new_tokens

    def run(sample, seed, xvec=False):
        kw = dict(max_new_tokens=mnt) if mnt is not None else {}
        if not sample:
            kw.update(do_sample=False, subtalker_dosample=False)
        else:
            kw.update(do_sample=True, subtalker_dosample=True)
            torch.manual_seed(seed)
        t = time.perf_counter()
        if kind == "custom_voice":
            wavs, sr = tts.generate_custom_voice(text=a.text, speaker="ryan", language="english", **kw)
        elif kind == "voice_design":
            wavs, sr = tts.generate_voice_design(text=a.text, instruct="A calm, low voice.",
                                                 language="english", **kw)
        else:
            rng = np.random.default_rng(0)
            ref = (0.3 * np.sin(2 * np.pi * 220 * np.arange(24000 * 2) / 24000)
                   + 0.05 * rng.standard_normal(24000 * 2)).astype(np.float32)
            wavs, sr = tts.generate_voice_clone(text=a.text, language="english",
                                                ref_audio=(ref, 24000), ref_text="A reference.",
                                                x_vector_only_mode=xvec, **kw)
        dt = time.perf_counter() - t
        codes = captured["codes"][0]
        seq = captured["talker_seq"][0]
        return dict(
            wav=wavs[0], sr=sr, codes=codes.numpy(), wall_s=dt,
            talker_steps=captured["talker_steps"], talker_first_codes=seq.tolist(),
            eos_emitted=bool((seq == eos).any()), used_kwargs=captured["kw"],
        )

    results = {}
    for mode, sample in (("greedy", False), ("sampled", True)):
        r1 = run(sample, a.seed)
        r2 = run(sample, a.seed)
        same_codes = r1["codes"].shape == r2["codes"].shape and np.array_equal(r1["codes"], r2["codes"])
        same_wav = r1["wav"].shape == r2["wav"].shape and np.array_equal(r1["wav"], r2["wav"])
        w = r1["wav"]
        info = dict(
            wav_shape=list(w.shape), wav_dtype=str(w.dtype), sample_rate=r1["sr"],
            codes_shape=list(r1["codes"].shape), frames=int(r1["codes"].shape[0]),
            samples_per_frame=(w.shape[0] / max(1, r1["codes"].shape[0])),
            talker_steps=r1["talker_steps"], eos_emitted=r1["eos_emitted"],
            wall_s=[round(r1["wall_s"], 2), round(r2["wall_s"], 2)],
            deterministic_codes=same_codes, deterministic_wav=same_wav,
            wav_stats=dict(min=float(w.min()), max=float(w.max()), std=float(w.std()),
                           frac_clipped=float((np.abs(w) >= 1.0).mean())),
            first_frames=r1["codes"][:3].tolist(),
            first_codes_group0=[int(x) for x in r1["codes"][:, 0][:20]],
            used_kwargs=r1["used_kwargs"],
        )
        if sample:
            r3 = run(True, a.seed + 1)
            info["other_seed_differs"] = not (r3["codes"].shape == r1["codes"].shape
                                              and np.array_equal(r3["codes"], r1["codes"]))
        results[mode] = info
        np.savez(os.path.join(a.out, f"{kind}-{mode}.npz"), wav=r1["wav"], codes=r1["codes"],
                 sr=r1["sr"])
        print(f"[{kind}] {mode}: " + json.dumps(info))

    if kind == "base":  # x-vector-only voice clone (no ref codes, speaker embedding only)
        r1, r2 = run(False, a.seed, xvec=True), run(False, a.seed, xvec=True)
        info = dict(wav_shape=list(r1["wav"].shape), codes_shape=list(r1["codes"].shape),
                    eos_emitted=r1["eos_emitted"], wall_s=[round(r1["wall_s"], 2), round(r2["wall_s"], 2)],
                    deterministic_codes=bool(np.array_equal(r1["codes"], r2["codes"])),
                    used_kwargs=r1["used_kwargs"])
        results["greedy_xvector_only"] = info
        np.savez(os.path.join(a.out, f"{kind}-greedy_xvec.npz"), wav=r1["wav"], codes=r1["codes"], sr=r1["sr"])
        print(f"[{kind}] greedy x_vector_only: " + json.dumps(info))

    # decoder alone: the codes -> wav path, compared with what generate returned
    codes = torch.from_numpy(np.load(os.path.join(a.out, f"{kind}-greedy.npz"))["codes"])
    t = time.perf_counter()
    wavs, sr = model.speech_tokenizer.decode([{"audio_codes": codes}])
    dec_s = time.perf_counter() - t
    ref = np.load(os.path.join(a.out, f"{kind}-greedy.npz"))["wav"]
    print(f"[{kind}] decode-only: {codes.shape[0]} frames -> {wavs[0].shape} in {dec_s:.2f}s, "
          f"equal to generate's wav: {np.array_equal(wavs[0], ref)}"
          + (" (base: generate decodes ref_code+codes, then cuts the ref part)" if kind == "base" else ""))
    with open(os.path.join(a.out, f"{kind}-summary.json"), "w") as f:
        json.dump(dict(load_s=load_s, **results), f, indent=1)


if __name__ == "__main__":
    main()
