"""qwen-tts's own generate functions, for the Qwen3-TTS equality tests: run by the side
environment's interpreter (omnipipe/families/qwen3_tts/reference_env.py), never imported
by the tests.

    python -P qwen_tts_reference.py CASES.json

CASES.json is a list of {"checkpoint", "out", "text", "speaker", "language", "instruct",
"ref_audio" (a data: URL of a WAV, Base's cloning), "ref_text" (its transcript: cloning in
context, else from the x-vector alone), "seed", "max_new_tokens"}, or of {"checkpoint",
"out", "decode": codes}, or of {"checkpoint", "out", "encode": a clip}: a case with a
seed samples (torch.manual_seed(seed) first, as
a user of qwen-tts seeds it), one without is greedy. Each case writes its "out" (.npz)
with the codes (frames x 16) and the waveform (float32, 24 kHz); each checkpoint is
loaded once."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from qwen_tts import Qwen3TTSModel


def decode(tts, case):
    """The speech tokenizer's audio of given codes, as generate_* decodes its own."""
    codes = torch.tensor(case["decode"], dtype=torch.long)
    wavs, rate = tts.model.speech_tokenizer.decode([{"audio_codes": codes}])
    return codes, wavs, rate


def speak(tts, case, captured):
    if "decode" in case:
        codes, wavs, rate = decode(tts, case)
        return save(case, codes, wavs, rate)
    if "encode" in case:  # the speech tokenizer's codes of a clip (no audio)
        codes = tts.model.speech_tokenizer.encode(case["encode"]).audio_codes[0]
        return save(case, codes.cpu(), [np.zeros(0, np.float32)], 24000)
    kwargs = {"max_new_tokens": case["max_new_tokens"]} if case.get("max_new_tokens") else {}
    if case.get("seed") is None:
        kwargs.update(do_sample=False, subtalker_dosample=False)
    else:
        torch.manual_seed(case["seed"])
    if tts.model.tts_model_type == "custom_voice":
        wavs, rate = tts.generate_custom_voice(
            text=case["text"],
            speaker=case["speaker"],
            language=case["language"],
            instruct=case.get("instruct"),
            **kwargs,
        )
    elif tts.model.tts_model_type == "base":
        wavs, rate = tts.generate_voice_clone(
            text=case["text"],
            language=case["language"],
            ref_audio=case["ref_audio"],
            ref_text=case.get("ref_text"),
            x_vector_only_mode=not case.get("ref_text"),
            **kwargs,
        )
    else:
        wavs, rate = tts.generate_voice_design(
            text=case["text"], instruct=case["instruct"], language=case["language"], **kwargs
        )
    return save(case, captured["codes"], wavs, rate)


def save(case, codes, wavs, rate):
    out = Path(case["out"])
    partial = out.with_suffix(f".{os.getpid()}.npz")
    np.savez(partial, codes=codes.numpy(), wav=np.asarray(wavs[0], dtype=np.float32), rate=rate)
    partial.replace(out)  # whole or not at all: another run may read it


def main():
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    loaded = {}
    for case in cases:
        if case["checkpoint"] not in loaded:
            tts = Qwen3TTSModel.from_pretrained(case["checkpoint"], dtype=torch.float32)
            captured = {}
            generate = tts.model.generate

            def keep_codes(*args, generate=generate, captured=captured, **kwargs):
                codes, hidden = generate(*args, **kwargs)  # the codes, before the audio
                captured["codes"] = codes[0].clone()
                return codes, hidden

            tts.model.generate = keep_codes
            loaded[case["checkpoint"]] = (tts, captured)
        tts, captured = loaded[case["checkpoint"]]
        speak(tts, case, captured)


if __name__ == "__main__":
    main()
