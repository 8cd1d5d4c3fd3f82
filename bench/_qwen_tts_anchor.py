"""bench/tts.py's anchor: qwen-tts's own generate_custom_voice, one request at a time,
timed in its side environment (omnipipe/families/qwen3_tts/reference_env.py). Run by the
side interpreter, never imported:

    python -P _qwen_tts_anchor.py CHECKPOINT TEXT SPEAKER MAX_NEW_TOKENS REQUESTS

Prints one JSON line: each request's seconds and the audio seconds it made (after one
request that pays the one-time costs)."""

import gc
import json
import sys
import time

import torch
from qwen_tts import Qwen3TTSModel


def main():
    checkpoint, text, speaker, max_new_tokens, requests = sys.argv[1:6]
    torch.set_num_threads(1)
    tts = Qwen3TTSModel.from_pretrained(checkpoint, dtype=torch.float32)
    kwargs = {"language": "english", "max_new_tokens": int(max_new_tokens)}
    tts.generate_custom_voice(text=text, speaker=speaker, **kwargs)
    seconds, audio = [], []
    for i in range(int(requests)):
        torch.manual_seed(i)
        started = time.perf_counter()
        wavs, rate = tts.generate_custom_voice(text=text, speaker=speaker, **kwargs)
        seconds.append(time.perf_counter() - started)
        audio.append(len(wavs[0]) / rate)
    print(json.dumps({"seconds": seconds, "audio_seconds": audio}))


if __name__ == "__main__":
    main()
    # Timed by its caller to the end: the interpreter's collections at exit would walk
    # torch's and transformers' objects for a second and more (bench/_common.py's
    # without_exit_collection).
    gc.freeze()
