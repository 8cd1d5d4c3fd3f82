"""The Qwen Omni code2wav stages on vLLM: each ready chunk of codes is one request to an
in-process pooling engine (code2wav_model.py), and one engine step decodes every
chunk of the call, those of equal length and voice in one forward. Chunking, left
context, voices and seeded noise are the transformers stages' (transformers/code2wav.py:
the reference), so a request's audio matches theirs within
float tolerance (tests/unit/test_vllm_code2wav.py)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen_omni import qwen3, qwen25
from omnipipe.families.qwen_omni.codec import seed_of
from omnipipe.families.qwen_omni.handoff import pick_voice
from omnipipe.stagekit.code2wav import (
    ChunkedCode2WavSession,
    ChunkedCode2WavStage,
    Decode,
    chunk_codes,
)
from omnipipe.stagekit.stage import Session, StageJob
from omnipipe.stagekit.vllm.engine import VllmEngine

MODELS = "omnipipe.families.qwen_omni.vllm.code2wav_model"
# engineArgs this stage reads itself; the rest go to vLLM.
OWN_ARGS = ("num_steps", "chunk_codes", "context_codes")
MAX_NUM_SEQS = 16
GPU_MEMORY_SHARE = 0.2


@dataclasses.dataclass(frozen=True)
class Code2WavConfigOverride:
    """vLLM's `hf_overrides`: the checkpoint's code2wav config (`part`) as the model
    config, under our architecture, with the codebook as the vocabulary vLLM checks
    prompt ids against. vLLM first calls it on a bare config to see whether the model
    type changes; that one goes through unchanged."""

    part: str
    architecture: str
    vocab_size: int
    extra: tuple[tuple[str, Any], ...] = ()

    def __call__(self, config: Any) -> Any:
        sub = getattr(config, self.part, None)
        if sub is None:
            return config
        sub.architectures = [self.architecture]
        sub.vocab_size = self.vocab_size
        sub.omnipipe = dict(self.extra)
        return sub


def own_args(engine_args: dict[str, Any], chunk: int, context: int) -> tuple[int, int]:
    chunk = chunk_codes(engine_args, chunk)
    context = int(engine_args.get("context_codes", context))
    if context < 0:
        raise ValueError(f"engineArgs.context_codes must be at least 0, not {context}")
    return chunk, context


class VllmCode2WavBase(ChunkedCode2WavStage):
    """The engine and the decoding; a family's stage says which part of the checkpoint,
    its config override, and the codes a step of the chunk holds."""

    codes_per_step = 1  # prompt ids per chunk position (Qwen3: a frame's codes)

    def start_engine(self, override: Code2WavConfigOverride, model_class: str, dtype: str) -> None:
        """`dtype`: what the transformers stage runs the model in on this device."""
        from vllm import ModelRegistry

        ModelRegistry.register_model(override.architecture, f"{MODELS}:{model_class}")
        self.vocab_size = override.vocab_size
        longest = (self.chunk_codes + self.context_codes) * self.codes_per_step
        args = {k: v for k, v in self.spec.engine_args.items() if k not in OWN_ARGS}
        args.setdefault("max_num_seqs", MAX_NUM_SEQS)
        if self.device.type == "cuda":
            # No KV cache to size: vLLM's default share (0.9) would refuse to start
            # beside another stage on the same GPU. Not measured on a GPU here.
            args.setdefault("gpu_memory_utilization", GPU_MEMORY_SHARE)
        # A full batch of the longest chunks in one step (vLLM warms its pooler up at
        # this size).
        args.setdefault("max_num_batched_tokens", int(args["max_num_seqs"]) * longest)
        if int(args["max_num_batched_tokens"]) < longest:
            # A model with no KV cache has no chunked prefill: a chunk runs whole.
            raise ValueError(
                f"engineArgs.max_num_batched_tokens {args['max_num_batched_tokens']} is "
                f"less than a whole chunk with its left context ({longest} codes)"
            )
        fixed = {
            "hf_overrides": override,
            "runner": "pooling",
            "skip_tokenizer_init": True,
            "max_model_len": longest,
            "dtype": dtype,
        }
        self.engine = VllmEngine(self.model_path, args, self.device, [], fixed)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Every chunk as one engine request, stepped until all are done: the engine's
        scheduler batches them (max_num_seqs at a time), its pooler decodes each step's
        chunks of equal length and voice in one forward."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        llm = self.engine.llm
        ids: list[str] = []
        audio: dict[str, np.ndarray] = {}
        try:
            for session, decode in zip(sessions, decodes, strict=True):
                assert isinstance(session, VllmCode2WavSession), "a session of another stage"
                self._check(decode.codes)
                ids.append(uuid.uuid4().hex)
                llm.add_request(
                    ids[-1],
                    TokensPrompt(prompt_token_ids=decode.codes.reshape(-1).tolist()),
                    PoolingParams(task="plugin", extra_kwargs=session.request_extra(decode)),
                )
            while len(audio) < len(ids):
                for output in llm.step():
                    if output.finished and output.request_id in ids:
                        data = output.outputs.data  # type: ignore[union-attr]
                        audio[output.request_id] = data.cpu().numpy()
                if len(audio) < len(ids) and not llm.has_unfinished_requests():
                    raise RuntimeError("the code2wav engine dropped a chunk without its audio")
        except BaseException:
            llm.abort_request([i for i in ids if i not in audio])
            raise
        return [audio[i] for i in ids]

    def _check(self, codes: torch.Tensor) -> None:
        """vLLM checks no prompt id without a tokenizer; a code past the codebook would
        fail the engine step, and with it every chunk of the step."""
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"code {high if high >= self.vocab_size else low} is outside the codec's "
                f"codebook of {self.vocab_size}"
            )


class VllmCode2WavSession(ChunkedCode2WavSession):
    def __init__(self, stage: VllmCode2WavBase, params: dict[str, Any], voice: str) -> None:
        super().__init__(stage, params)
        self.stage = stage
        self.voice = voice
        self.seed = seed_of(params)

    def request_extra(self, decode: Decode) -> dict[str, Any]:
        """What the engine's model needs beyond the codes: the voice, the left context,
        and the seed of this chunk's noise, as the transformers stage seeds it."""
        return {
            "voice": self.voice,
            "context": decode.context,
            "seed": None if self.seed is None else self.seed + self.decoded,
        }

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        end = self.decoded + len(codes) - context
        return self.stage.decode_many([self], [Decode(codes, context, end)])[0]


class VllmQwen25Code2WavStage(VllmCode2WavBase):
    def load(self) -> None:
        from transformers import AutoConfig

        from omnipipe.families.qwen_omni.vllm.code2wav_model import (
            QWEN25_ARCHITECTURE,
            load_speakers,
        )

        config = AutoConfig.from_pretrained(self.model_path)
        args = self.spec.engine_args
        num_steps = int(args.get("num_steps", 10))
        if num_steps < 1:
            raise ValueError(f"engineArgs.num_steps must be at least 1, not {num_steps}")
        self.chunk_codes, self.context_codes = own_args(
            args, qwen25.CHUNK_CODES, qwen25.CONTEXT_CODES
        )
        self.voices = list(load_speakers(self.model_path))
        override = Code2WavConfigOverride(
            "token2wav_config",
            QWEN25_ARCHITECTURE,
            # The DiT's codec embedding has num_embeds + 1 rows.
            int(config.token2wav_config.dit_config.num_embeds) + 1,
            (("num_steps", num_steps), ("samples_per_code", qwen25.samples_per_code(config))),
        )
        # transformers runs token2wav in float32 only.
        self.start_engine(override, "Qwen25Code2WavModel", "float32")

    def open(self, job: StageJob) -> Session:
        return VllmCode2WavSession(self, job.params, pick_voice(job.params, self.voices))


class VllmQwen3Code2WavStage(VllmCode2WavBase):
    def load(self) -> None:
        from transformers import AutoConfig

        from omnipipe.families.qwen_omni.vllm.code2wav_model import QWEN3_ARCHITECTURE

        config = AutoConfig.from_pretrained(self.model_path)
        self.voices = qwen3.voices(config)
        self.chunk_codes, self.context_codes = own_args(
            self.spec.engine_args, qwen3.CHUNK_FRAMES, qwen3.CONTEXT_FRAMES
        )
        c2w = config.code2wav_config
        self.codes_per_step = int(c2w.num_quantizers)
        override = Code2WavConfigOverride(
            "code2wav_config",
            QWEN3_ARCHITECTURE,
            int(c2w.codebook_size),
            (("samples_per_frame", qwen3.samples_per_frame(config)),),
        )
        # As load_qwen3_omni: the checkpoint's bfloat16 on a GPU.
        dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.start_engine(override, "Qwen3Code2WavModel", dtype)

    def open(self, job: StageJob) -> Session:
        # The talker speaks the voice; a bad one fails here early, as on transformers.
        pick_voice(job.params, self.voices)
        return VllmCode2WavSession(self, job.params, "")
