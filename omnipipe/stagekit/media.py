"""Decode the images and audio clips of a chat request, and charge its media (a video
too) to the request's budget; bad bytes are the client's error."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
import wave
from collections.abc import Mapping

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.stagekit.stage import StageInputError

MAX_AUDIO_SECONDS = 300
MAX_IMAGE_PIXELS = 64_000_000
# The vision processors' limit (Qwen2-VL's smart_resize takes less than 200:1); a longer
# strip is refused here, with its size, before any processor sees it.
MAX_ASPECT_RATIO = 200
# A progressive JPEG decodes its coefficients once a scan: 5 MB of many small scans took
# 144 s, within every pixel limit. Encoders write 1 (baseline) to about 12 (progressive);
# libjpeg-turbo's tools advise a cap of 100 for untrusted files (djpeg -maxscans).
MAX_JPEG_SCANS = 100
# Start of Scan: inside a scan's entropy-coded data every 0xFF byte is stuffed (FF 00), so
# each occurrence starts a scan (or sits in a metadata segment: an upper bound either way).
_JPEG_SOS = b"\xff\xda"


class MediaBudget:
    """What one request's media may still take, charged from each item's header before
    the item is decoded: what a request decodes is bounded by its limits, not its bytes
    (six 8000x8000 one-colour PNGs are 1.6 MB of body and 1.1 GB decoded). `notes` add to
    a refusal, by limit (field name), where the limit comes from: the model's, named."""

    def __init__(self, limits: MediaLimits, notes: Mapping[str, str] | None = None) -> None:
        self.limits = limits
        self.notes = notes or {}
        self.images = self.pixels = self.clips = 0
        self.seconds = 0.0

    def _refusal(self, message: str, limit: str, param: str | None = None) -> StageInputError:
        note = self.notes.get(limit)
        return StageInputError(f"{message} ({note})" if note else message, param=param)

    def take_image(self, width: int, height: int, where: str) -> None:
        lim = self.limits
        if self.images + 1 > lim.max_images:
            raise self._refusal(
                f"{where}: more than {lim.max_images} images in one request",
                "max_images",
                param="messages",
            )
        if self.pixels + width * height > lim.max_image_pixels:
            raise self._refusal(
                f"{where}: {width}x{height} takes the request's images past their limit of "
                f"{lim.max_image_pixels} pixels in all",
                "max_image_pixels",
            )
        self.images += 1
        self.pixels += width * height

    def take_audio(self, frames: int, rate: int, where: str) -> None:
        lim = self.limits
        if not lim.min_sample_rate <= rate <= lim.max_sample_rate:
            raise StageInputError(
                f"{where}: sample rate {rate} Hz is outside {lim.min_sample_rate} to "
                f"{lim.max_sample_rate} Hz"
            )
        if self.clips + 1 > lim.max_audio_clips:
            raise self._refusal(
                f"{where}: more than {lim.max_audio_clips} audio clips in one request",
                "max_audio_clips",
                param="messages",
            )
        seconds = frames / rate
        if seconds > lim.max_audio_clip_seconds:
            raise self._refusal(
                f"{where}: the clip is {seconds:.1f}s, past the limit of "
                f"{lim.max_audio_clip_seconds:g}s a clip",
                "max_audio_clip_seconds",
            )
        if self.seconds + seconds > lim.max_audio_seconds:
            raise self._refusal(
                f"{where}: {seconds:.0f}s takes the request's audio past its limit of "
                f"{lim.max_audio_seconds:.0f}s in all",
                "max_audio_seconds",
            )
        self.clips += 1
        self.seconds += seconds

    def take_video(self, frames: int, seconds: float, where: str) -> None:
        """Charge a video for the frames it keeps once sampled (its demuxed length known,
        no frame decoded)."""
        lim = self.limits
        if frames > lim.max_video_frames:
            raise self._refusal(
                f"{where}: the video keeps {frames} frames of its {seconds:.1f}s once "
                f"sampled, past the limit of {lim.max_video_frames} frames (send a shorter "
                "clip or a lower mm_processor_kwargs.fps)",
                "max_video_frames",
            )


def _bytes(data: object, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise StageInputError(f"{where}: expected base64 data")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise StageInputError(f"{where}: not valid base64") from None


def _too_large(where: str, size: str = "the image") -> StageInputError:
    return StageInputError(f"{where}: {size} is over the limit of {MAX_IMAGE_PIXELS} pixels")


def _open_image(raw: bytes, where: str) -> Image.Image:
    """The image, opened lazily (its header read, nothing decoded), once its header says
    it is within the pixel and aspect-ratio limits."""
    try:
        with warnings.catch_warnings():
            # Past PIL's warning size the header is still read; the size is checked here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:  # PIL's own limit, far above ours
        raise _too_large(where) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise StageInputError(_undecodable(where)) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        image.close()
        raise _too_large(where, f"{width}x{height}")
    if width < 1 or height < 1:
        image.close()
        raise StageInputError(f"{where}: the image has no pixels ({width}x{height})")
    if max(width, height) >= MAX_ASPECT_RATIO * min(width, height):
        image.close()
        raise StageInputError(
            f"{where}: {width}x{height} is past the aspect-ratio limit: the longer side "
            f"must be less than {MAX_ASPECT_RATIO} times the shorter"
        )
    if image.format == "JPEG" and (scans := raw.count(_JPEG_SOS)) > MAX_JPEG_SCANS:
        image.close()
        raise StageInputError(
            f"{where}: a JPEG of {scans} scans is past the limit of {MAX_JPEG_SCANS} (each "
            "scan is decoded in turn; save it as a baseline or standard progressive JPEG)"
        )
    return image


def _undecodable(where: str) -> str:
    return f"{where}: not a decodable image (PNG, JPEG, WebP, GIF)"


def charge_image(data: object, where: str, budget: MediaBudget) -> None:
    """Charge the request's budget for an image from its header alone."""
    with _open_image(_bytes(data, where), where) as image:
        budget.take_image(*image.size, where)


# What PIL raises for a file whose header reads well and whose body does not (a PNG
# chunk of a bad type raises SyntaxError, a cut-off one EOFError).
UNDECODABLE = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    struct.error,
    Image.DecompressionBombError,
)


def decode_image(data: object, where: str) -> Image.Image:
    """The image, once its header says it is within the pixel and aspect-ratio limits."""
    with _open_image(_bytes(data, where), where) as image:
        try:
            return image.convert("RGB")
        except UNDECODABLE:
            raise StageInputError(_undecodable(where)) from None


def _wav_header(wav: wave.Wave_read, where: str) -> tuple[int, int, int, int]:
    """Sample width, channels, rate and frame count, once they are within the limits."""
    width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
    count = wav.getnframes()
    if channels < 1 or rate < 1:
        raise StageInputError(f"{where}: the WAV header has no channels or no rate")
    if count > MAX_AUDIO_SECONDS * rate:
        raise StageInputError(f"{where}: audio longer than {MAX_AUDIO_SECONDS}s")
    return width, channels, rate, count


def _read_wav(raw: bytes, where: str, frames: bool) -> tuple[int, int, int, int, bytes]:
    try:
        with wave.open(io.BytesIO(raw)) as wav:
            width, channels, rate, count = _wav_header(wav, where)
            return width, channels, rate, count, wav.readframes(count) if frames else b""
    except (wave.Error, EOFError, ValueError, struct.error) as exc:
        if isinstance(exc, StageInputError):
            raise
        raise StageInputError(f"{where}: not a decodable WAV file") from None


def charge_wav(data: object, where: str, budget: MediaBudget) -> None:
    """Charge the request's budget for a clip from its header alone (its claimed length:
    a clip cut short is charged for what it claims)."""
    _, _, rate, count, _ = _read_wav(_bytes(data, where), where, frames=False)
    budget.take_audio(count, rate, where)


def decode_wav(data: object, where: str, sample_rate: int) -> np.ndarray:
    """A mono float32 waveform at sample_rate from WAV (PCM 8/16/24/32-bit) bytes. A clip
    cut short keeps its whole frames; one with none is the client's error."""
    width, channels, rate, _, frames = _read_wav(_bytes(data, where), where, frames=True)
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


def charge_media(
    messages: object, budget: MediaBudget, kinds: tuple[str, ...] = ("image", "audio")
) -> None:
    """Charge the budget for every image and clip (of `kinds`, those the stage takes) of
    the messages from their headers, before any is decoded: a request over its budget
    decodes nothing. Malformed messages are left for the caller's own checks."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds:
                continue
            if kind == "image":
                charge_image(part.get("data"), f"messages[{i}].content[{j}]", budget)
            elif kind == "audio":
                charge_wav(part.get("data"), f"messages[{i}].content[{j}]", budget)


def pcm16(waveform: np.ndarray) -> bytes:
    return bytes((np.clip(waveform, -1.0, 1.0) * 32767).astype("<i2").tobytes())
