"""Speech as the client asked for it (OpenAI's `response_format` and `speed`): 16-bit mono
PCM in, the bytes of the requested container out, piece by piece as the audio is made, so
the first bytes leave with the first audio. Encoded with PyAV (FFmpeg's codecs: LAME for
MP3, FFmpeg's AAC in ADTS, libopus in Ogg, FLAC); `speed` is FFmpeg's atempo, a
time-stretch that keeps the pitch. wav and pcm come out as PCM: the router writes WAV's
header, which needs the length."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import av
import numpy as np

SPEECH_FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm")
PCM_FORMATS = frozenset({"wav", "pcm"})
# format -> (container, codec, the codec's sample format, bit rate or None)
ENCODED: dict[str, tuple[str, str, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", "s16p", 64_000),
    "aac": ("adts", "aac", "fltp", 64_000),
    "opus": ("ogg", "libopus", "s16", 48_000),
    "flac": ("flac", "flac", "s16", None),
}
# Ogg writes a page once the next has begun, a second of audio each by default: the
# first Opus bytes would wait that long. 100 ms pages stream it as it is made.
MUXER_OPTIONS = {"ogg": {"page_duration": "100000"}}
MIN_SPEED, MAX_SPEED = 0.25, 4.0
# One atempo stage stretches by 0.5 to 100; slower speeds chain two.
ATEMPO_MIN = 0.5


def tempo_factors(speed: float) -> list[float]:
    """atempo stages whose product is `speed` (1.0: none)."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be from {MIN_SPEED} to {MAX_SPEED}, got {speed:g}")
    if speed == 1.0:
        return []
    if speed >= ATEMPO_MIN:
        return [speed]
    return [ATEMPO_MIN, speed / ATEMPO_MIN]


def _frame(pcm: np.ndarray, rate: int, pts: int | None) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = rate
    frame.pts = pts
    if pts is not None:
        frame.time_base = Fraction(1, rate)
    return frame


class _Tempo:
    """FFmpeg's atempo filter graph: frames in, frames at the new speed out."""

    def __init__(self, rate: int, factors: list[float]) -> None:
        self.rate = rate
        self.graph = av.filter.Graph()
        nodes = [
            self.graph.add_abuffer(
                format="s16", sample_rate=rate, layout="mono", time_base=Fraction(1, rate)
            ),
            *(self.graph.add("atempo", f"{f:.6f}") for f in factors),
            self.graph.add("abuffersink"),
        ]
        for a, b in itertools.pairwise(nodes):
            a.link_to(b)
        self.graph.configure()
        self.samples = 0

    def run(self, pcm: np.ndarray | None) -> np.ndarray:
        """Push PCM (None: the end) and pull what is ready."""
        if pcm is None:
            self.graph.push(None)
        elif len(pcm):
            self.graph.push(_frame(pcm, self.rate, self.samples))
            self.samples += len(pcm)
        out: list[np.ndarray] = []
        while True:
            try:
                frame: Any = self.graph.pull()
            except (BlockingIOError, EOFError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.int16))
        return np.concatenate(out) if out else np.zeros(0, np.int16)


class _Sink:
    """A write-only file for the muxer: what it wrote since the last take."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.pieces.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self.pieces = b"".join(self.pieces), []
        return data


class SpeechEncoder:
    """One answer's audio: `push` PCM as it is made, `finish` at the end; each returns
    the bytes ready to send."""

    def __init__(self, fmt: str, rate: int, speed: float = 1.0) -> None:
        if fmt not in SPEECH_FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(SPEECH_FORMATS)}")
        self.fmt, self.rate = fmt, rate
        factors = tempo_factors(speed)
        self.tempo = _Tempo(rate, factors) if factors else None
        self.sink = _Sink()
        self.container: Any = None
        if fmt in ENCODED:
            name, codec, sample_format, bit_rate = ENCODED[fmt]
            self.container = av.open(
                self.sink, mode="w", format=name, options=MUXER_OPTIONS.get(name, {})
            )
            self.stream = self.container.add_stream(codec, rate=rate, layout="mono")
            if bit_rate:
                self.stream.bit_rate = bit_rate
            self.stream.format = sample_format
            self.resampler = av.AudioResampler(format=sample_format, layout="mono", rate=rate)
            self.fifo = av.AudioFifo()
            self.written = 0

    def _encode(self, pcm: np.ndarray, last: bool) -> bytes:
        if self.container is None:
            return pcm.astype("<i2").tobytes()
        if len(pcm):
            for converted in self.resampler.resample(_frame(pcm, self.rate, None)):
                converted.pts = None
                self.fifo.write(converted)
        size = self.stream.codec_context.frame_size or 1024
        while self.fifo.samples >= size or (last and self.fifo.samples):
            frame = self.fifo.read(min(size, self.fifo.samples))
            if frame is None:
                break
            frame.pts = self.written
            frame.time_base = Fraction(1, self.rate)
            self.written += frame.samples
            self.container.mux(self.stream.encode(frame))
        if last:
            try:
                self.container.mux(self.stream.encode(None))
            finally:
                self.close()
        return self.sink.take()

    def push(self, pcm16: bytes) -> bytes:
        pcm = np.frombuffer(pcm16, dtype="<i2")
        if self.tempo is not None:
            pcm = self.tempo.run(pcm)
        return self._encode(pcm, last=False)

    def close(self) -> None:
        """Free the codec, the muxer and the filter graph: at the end, or when the
        request is cancelled before it (its session's close)."""
        if self.container is not None:
            with contextlib.suppress(Exception):
                self.container.close()
            self.container = None
        self.tempo = None

    def finish(self) -> bytes:
        pcm = self.tempo.run(None) if self.tempo is not None else np.zeros(0, np.int16)
        return self._encode(pcm, last=True)


def speech_encoder(params: Mapping[str, Any], rate: int) -> SpeechEncoder | None:
    """The encoder a request's params ask for (`response_format`, `speed`), or None for
    plain PCM at speed 1 (chat's audio, or speech as wav or pcm at its own pace)."""
    fmt = params.get("response_format")
    speed = float(params.get("speed") or 1.0)
    if fmt is None or (fmt in PCM_FORMATS and speed == 1.0):
        return None
    return SpeechEncoder(str(fmt), rate, speed)
