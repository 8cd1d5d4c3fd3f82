"""What the talker stages of every Qwen Omni family share: how they take the thinker's
chunks and when they send codes downstream. Subclasses run the model. (Their code2wav
stages are the stage kit's chunked code2wav, stagekit/code2wav.py.)

A talker "code" here is one step of the talker: one codec code (Qwen2.5-Omni) or one
frame of num_code_groups codes (Qwen3-Omni)."""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StepResult,
    StreamingStage,
    Tensors,
)


def seed_of(params: dict[str, Any]) -> int | None:
    """The request's seed, when it chose one."""
    seed = params.get("seed")
    return seed if isinstance(seed, int) else None


class CodecTalkerStage(StreamingStage):
    # Set by load(): built-in defaults merged with the spec's sampling, codes per chunk
    # sent to code2wav, and how many codes make a second of audio.
    sampling: Sampling
    chunk_codes: int
    codes_per_second: float


class TalkerSessionBase(Session):
    """Takes the thinker's chunks (its prompt package, then one reply row per token) and
    sends the codes made downstream chunk_codes at a time; how codes are made is the
    subclass's (one request's forwards here, or a shared engine)."""

    def __init__(self, stage: CodecTalkerStage, params: dict[str, Any]) -> None:
        self.sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        self.sampling = self.sampling.with_request_seed(params)
        self.generator = self.sampling.generator(stage.device)
        self.chunk_codes = stage.chunk_codes
        self.codes_per_second = stage.codes_per_second
        self.prompt: Tensors | None = None
        self.replies: deque[torch.Tensor] = deque()  # the thinker's rows, as sent
        self.upstream_done = False
        self.sent = 0

    @property
    @abstractmethod
    def made(self) -> list[Any]:
        """The codes made so far, in order; what is sent downstream."""

    def _take(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            if "prompt_embeds" in chunk.tensors:
                self.prompt = chunk.tensors
            if "reply" in chunk.tensors:
                self.replies.extend(torch.split(chunk.tensors["reply"], 1))
            self.upstream_done = self.upstream_done or chunk.final

    def _emit(self, done: bool) -> StepResult:
        made = self.made
        if len(made) - self.sent < self.chunk_codes and not done:
            return StepResult()
        chunk = made[self.sent :]
        self.sent = len(made)
        return StepResult(
            tensors={"codes": torch.tensor(chunk, dtype=torch.long)} if chunk else {},
            done=done,
            audio_seconds=len(chunk) / self.codes_per_second,
        )


class CodecTalkerSession(TalkerSessionBase):
    """Prefills once the prompt and the first row are in, then steps once per reply row,
    one request's forwards at a time."""

    def __init__(self, stage: CodecTalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.cache: Any = None  # its own KV cache, and its rope deltas
        self.rope_deltas: torch.Tensor | None = None

    @abstractmethod
    def _prefill(self) -> torch.Tensor:
        """Run the prompt; the logits for the first code."""

    @abstractmethod
    def _next_row(self) -> torch.Tensor | None:
        """The text row the next step consumes; None until the thinker sends more."""

    @abstractmethod
    def _forward(self, row: torch.Tensor) -> torch.Tensor:
        """One step on the last code and the text row; the logits for the next code."""

    @abstractmethod
    def _choose(self, logits: torch.Tensor) -> bool:
        """Sample the next code and record it; True when the answer is complete."""

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        self._take(chunks)
        with torch.inference_mode():
            if self.cache is None:
                if self.prompt is None or not self.replies:
                    if self.upstream_done:
                        raise StageInputError("the thinker ended without a reply for the talker")
                    return None
                logits = self._prefill()
            else:
                row = self._next_row()
                if row is None:
                    return None
                logits = self._forward(row)
        return self._emit(self._choose(logits))

    def close(self) -> None:
        self.cache = None
