"""Codec frames on a vLLM talker: the row feed plus, per request, what a code predictor
needs and made. What every multi-codebook talker on vLLM shares (Qwen3-Omni's, Qwen3-TTS's);
the family gives its predictor (make_frames).

A frame is the talker's first code plus the code predictor's codes, which it makes from
[the talker's last state, the first code's embedding]. The frame's summed embedding (plus
the row) is the talker's next input, so the predictor runs inside the forward that feeds
the first code back, for every such row of the batch at once, with the state the
previous forward left here. Frames are kept by position: a recompute, or a resumed
request whose prompt holds earlier codes, reuses them.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.vllm.feed import RowFeed, StepFeed


def fed_inputs(
    feed: StepFeed | None, frames: FrameFeed | None, codec: torch.Tensor, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A frame talker's decoder input and the feed's positions (None: vLLM's profile and
    warm-up runs, which get the codec embeddings `codec` of input_ids as they are): each
    row's feed row, plus from codec_from on its frame's sum where a first code is fed
    back, else its codec embedding."""
    if feed is None or frames is None:
        return codec, None
    mask, totals = frames.frame_embeddings(feed, input_ids)
    rows = feed.rows.to(codec.dtype)
    own = torch.where(mask[:, None], totals.to(codec.dtype), codec)
    return torch.where(feed.add_codec[:, None], own + rows, rows), feed.positions


@dataclass
class FrameState:
    frames_from: int  # the first position a first code is fed at
    sampling: Sampling  # the code predictor's
    generator: torch.Generator | None
    codes: dict[int, list[int]] = field(default_factory=dict)  # position -> residual codes
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> frame sum
    # The talker's state at the last position of each forward, until the frame after it
    # is made: a recompute after preemption (even one split into chunks) finds it here.
    states: dict[int, torch.Tensor] = field(default_factory=dict)


class FrameFeed(RowFeed):
    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, FrameState] = {}
        self.model: Any = None

    def attach(self, model: Any) -> None:
        self.model = model
        model.frames = self  # the model's forward asks it for the frames

    @abstractmethod
    def make_frames(
        self, states: list[FrameState], past: torch.Tensor, codes: torch.Tensor
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The predictor's codes and each frame's summed embedding (hidden), for first
        codes `codes` (B) after the talker's states `past` (B x 1 x hidden), each frame
        sampled with its state's sampling and generator."""

    def embedding_dim(self) -> int:
        return int(self.model.codec_embedding.embedding_dim)

    def track(self, request_id: str, state: FrameState) -> None:
        with self._lock:
            self.states[request_id] = state

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        with self._lock:
            self.states.pop(request_id, None)

    def after_forward(self, step: StepFeed, hidden: torch.Tensor) -> None:
        for span in step.spans:
            state = self.states.get(span.request_id)
            if state is not None and span.end > span.begin:
                last = span.start + span.end - span.begin - 1
                if last + 1 >= state.frames_from and last + 1 not in state.embeds:
                    state.states[last] = hidden[span.end - 1].detach().clone()

    def frame_embeddings(
        self, step: StepFeed, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask, sums): which rows feed a first code back, and their frames' summed
        embeddings, running the code predictor for the frames not made yet."""
        n = input_ids.shape[0]
        mask = torch.zeros(n, dtype=torch.bool)
        sums: list[tuple[int, torch.Tensor]] = []
        fresh: list[tuple[int, int, FrameState]] = []  # row, position, state
        for span in step.spans:
            state = self.states.get(span.request_id)
            if state is None:
                continue
            for row in range(span.begin, span.end):
                position = span.start + row - span.begin
                if position < state.frames_from:
                    continue
                mask[row] = True
                if position in state.embeds:
                    sums.append((row, state.embeds[position]))
                else:
                    fresh.append((row, position, state))
        out = torch.zeros(n, self.embedding_dim(), device=input_ids.device)
        if fresh:
            made = self._predict(
                [s for _, _, s in fresh],
                [p for _, p, _ in fresh],
                input_ids[torch.tensor([r for r, _, _ in fresh])],
            )
            sums += [(row, total) for (row, _, _), total in zip(fresh, made, strict=True)]
        for row, total in sums:
            out[row] = total
        return mask.to(input_ids.device), out

    def complete(self, state: FrameState, position: int, code: int) -> None:
        """Make the frame of a first code that was sampled but never fed back (the last
        one of a request that stopped short of rows), before it is fed as a prompt."""
        device = self.model.codec_embedding.weight.device
        with torch.inference_mode():
            self._predict([state], [position], torch.tensor([code], device=device))

    def _predict(
        self, states: list[FrameState], positions: list[int], codes: torch.Tensor
    ) -> list[torch.Tensor]:
        pairs = list(zip(states, positions, strict=True))
        missing = [p - 1 for state, p in pairs if p - 1 not in state.states]
        if missing:
            raise RuntimeError(f"frames: no talker state for position(s) {missing}")
        past = torch.stack([state.states[p - 1] for state, p in pairs])[:, None]
        picks, totals = self.make_frames(states, past, codes)
        with self._lock:
            for state, position, codes_, total in zip(
                states, positions, picks, totals, strict=True
            ):
                state.codes[position] = codes_
                state.embeds[position] = total
                del state.states[position - 1]
        return totals
