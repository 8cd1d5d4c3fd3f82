"""The tiny Qwen-Omni pipelines that test_omni.py and test_omni_video.py share: one
`omnipipe serve` per variant serves both modules (tests/e2e/conftest.py: omni_served)."""

from __future__ import annotations

import math
from dataclasses import dataclass

THINKER_TOKENS = 12
TALKER_CODES = 60  # 25 + 25 + 10: three chunks from talker to code2wav
CHUNK_CODES = 25
MODEL = "tiny-omni"


@dataclass(frozen=True)
class Variant:
    model: str
    pipeline: str
    samples_per_code: int
    # Qwen3's causal code2wav drops a fixed tail of samples per decoded chunk, as
    # transformers' chunked_decode does.
    samples_lost_per_chunk: int
    # Qwen3's talker, as generate() counts max_new_tokens, makes one code less than
    # max_tokens: the last code sampled never gets its residual codes.
    codes_short_of_max: int
    # The talker's and code2wav's engine.
    speech_engine: str = "transformers"

    def talker_tokens(self, codes: int) -> int:
        return codes + self.codes_short_of_max

    def samples(self, codes: int) -> int:
        chunks = math.ceil(codes / CHUNK_CODES)
        return codes * self.samples_per_code - chunks * self.samples_lost_per_chunk

    def manifest(self) -> str:
        talker = self.talker_tokens(TALKER_CODES)
        return f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {MODEL}}}
spec:
  model: {self.model}
  pipeline: {self.pipeline}
  stages:
    - name: thinker
      sampling: {{maxTokens: {THINKER_TOKENS}, minTokens: {THINKER_TOKENS}}}
    - name: talker
      engine: {self.speech_engine}
      sampling: {{maxTokens: {talker}, minTokens: {talker}}}
    - name: code2wav
      engine: {self.speech_engine}
"""


VARIANTS = {
    # 2 mel frames per code x 240 samples per frame, at 24 kHz.
    "qwen2.5-omni": Variant("tiny://qwen2.5-omni", "qwen2.5-omni", 480, 0, 0),
    # 8 x 5 x 4 x 3 x 2 x 2 upsampling per code; the causal transposed convolutions
    # of the tiny config drop 555 samples at the end of each chunk.
    "qwen3-omni": Variant("tiny://qwen3-omni", "qwen3-omni", 1920, 555, 1),
    # Every stage on vLLM: thinker, talker and code2wav.
    "qwen2.5-omni-vllm": Variant(
        "tiny://qwen2.5-omni", "qwen2.5-omni", 480, 0, 0, speech_engine="vllm"
    ),
    "qwen3-omni-vllm": Variant(
        "tiny://qwen3-omni", "qwen3-omni", 1920, 555, 1, speech_engine="vllm"
    ),
}
AUDIO = {"voice": "Chelsie", "format": "wav"}
HELLO = [{"role": "user", "content": "hello"}]
