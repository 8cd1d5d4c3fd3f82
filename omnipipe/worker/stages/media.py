"""Decode the images and audio clips of a chat request; bad bytes are the client's error."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
import wave

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnipipe.worker.stages.base import StageInputError

MAX_AUDIO_SECONDS = 300
MAX_IMAGE_PIXELS = 64_000_000
# The vision processors' limit (Qwen2-VL's smart_resize takes less than 200:1); a longer
# strip is refused here, with its size, before any processor sees it.
MAX_ASPECT_RATIO = 200


def _bytes(data: object, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise StageInputError(f"{where}: expected base64 data")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise StageInputError(f"{where}: not valid base64") from None


def _too_large(where: str, size: str = "the image") -> StageInputError:
    return StageInputError(f"{where}: {size} is over the limit of {MAX_IMAGE_PIXELS} pixels")


def decode_image(data: object, where: str) -> Image.Image:
    """The image, once its header says it is within the pixel and aspect-ratio limits."""
    raw = _bytes(data, where)
    undecodable = f"{where}: not a decodable image (PNG, JPEG, WebP, GIF)"
    try:
        with warnings.catch_warnings():
            # Past PIL's warning size the header is still read; the size is checked here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:  # PIL's own limit, far above ours
        raise _too_large(where) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise StageInputError(undecodable) from None
    with image:
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise _too_large(where, f"{width}x{height}")
        if width < 1 or height < 1:
            raise StageInputError(f"{where}: the image has no pixels ({width}x{height})")
        if max(width, height) >= MAX_ASPECT_RATIO * min(width, height):
            raise StageInputError(
                f"{where}: {width}x{height} is past the aspect-ratio limit: the longer side "
                f"must be less than {MAX_ASPECT_RATIO} times the shorter"
            )
        try:
            return image.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError):
            raise StageInputError(undecodable) from None


def decode_wav(data: object, where: str, sample_rate: int) -> np.ndarray:
    """A mono float32 waveform at sample_rate from WAV (PCM 8/16/24/32-bit) bytes. A clip
    cut short keeps its whole frames; one with none is the client's error."""
    raw = _bytes(data, where)
    try:
        with wave.open(io.BytesIO(raw)) as wav:
            width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
            count = wav.getnframes()
            too_long = count > MAX_AUDIO_SECONDS * rate
            frames = b"" if too_long else wav.readframes(count)
    except (wave.Error, EOFError, ValueError, struct.error):
        raise StageInputError(f"{where}: not a decodable WAV file") from None
    if channels < 1 or rate < 1:
        raise StageInputError(f"{where}: the WAV header has no channels or no rate")
    if too_long:
        raise StageInputError(f"{where}: audio longer than {MAX_AUDIO_SECONDS}s")
    if width not in (1, 2, 3, 4):
        raise StageInputError(f"{where}: unsupported WAV sample width {8 * width}-bit")
    # A truncated file (an odd byte count, a partial last frame) ends on a whole frame.
    whole = len(frames) - len(frames) % (width * channels)
    if whole == 0:
        raise StageInputError(f"{where}: the WAV file holds no audio")
    frames = frames[:whole]
    if width == 1:
        samples = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128) / 128
    elif width == 3:
        padded = np.frombuffer(frames, np.uint8).reshape(-1, 3)
        as_int = np.zeros((len(padded), 4), np.uint8)
        as_int[:, 1:] = padded
        samples = as_int.view("<i4").reshape(-1).astype(np.float32) / 2**31
    else:
        dtype = "<i2" if width == 2 else "<i4"
        samples = np.frombuffer(frames, dtype).astype(np.float32) / 2 ** (8 * width - 1)
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != sample_rate:
        duration = len(samples) / rate
        grid = np.linspace(0, duration, int(duration * sample_rate), endpoint=False)
        samples = np.interp(grid, np.arange(len(samples)) / rate, samples).astype(np.float32)
    if len(samples) == 0:
        raise StageInputError(f"{where}: the WAV clip is too short to resample")
    return np.asarray(samples, dtype=np.float32)


def pcm16(waveform: np.ndarray) -> bytes:
    return bytes((np.clip(waveform, -1.0, 1.0) * 32767).astype("<i2").tobytes())
