"""Checks on what a client sends that the router can make before any stage runs: inline
media (base64, data: URLs, WAV headers) and sampling values that would break an engine's
arithmetic. Each failure is a 400 that names the parameter and the limit."""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct
import warnings
import wave
from typing import Any

from omnipipe.api.plain_text import shown
from omnipipe.router.errors import BadRequest

# The thinker's limit on an input clip (stagekit/media.py holds the same).
MAX_AUDIO_SECONDS = 300
WAV_SAMPLE_WIDTHS = (1, 2, 3, 4)
# The thinker's limits on a video (stagekit/video.py holds the same); its length is
# checked where it is demuxed.
MAX_VIDEO_BYTES = 16 * 1024 * 1024
MAX_VIDEO_SECONDS = 300
MAX_VIDEOS = 1
VIDEO_TYPES = ("video/mp4", "video/webm")
MAX_SAMPLING_FPS = 8.0
PROCESSOR_KWARGS = ("use_audio_in_video", "fps")
# Below this a positive temperature, top_p or repetition penalty turns into zero or
# infinity in an engine's float32 arithmetic (a subnormal top_p is 0.0 there), and the
# sampler has nothing left to pick from. Temperature 0 stays: it means greedy.
MIN_POSITIVE_SAMPLING = 1e-6
POSITIVE_SAMPLING = ("top_p", "repetition_penalty")


def base64_data(data: object, param: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise BadRequest(f"{param}: expected base64 data", param=param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{param}: not valid base64", param=param) from None


def image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(
            f"{param}.image_url: send the image inline as a data: URL "
            "(data:image/png;base64,...); the router fetches no URLs",
            param=param,
        )
    header, _, data = url.partition(",")
    if not header.endswith(";base64"):
        raise BadRequest(f"{param}.image_url: the data: URL must be base64", param=param)
    where = f"{param}.image_url"
    declared = header.removeprefix("data:").split(";")[0].strip().lower()
    if declared and declared not in IMAGE_TYPES:
        raise BadRequest(
            f"{where}: only {', '.join(IMAGE_TYPES)} data: URLs are supported, got "
            f"{declared[:64]!r}",
            param=param,
        )
    actual = image_format(base64_data(data, where))
    if actual is None:
        raise BadRequest(
            f"{where}: not a decodable image: the data is no PNG, JPEG, WebP or GIF file",
            param=param,
        )
    if declared and IMAGE_TYPES[declared] != actual:
        raise BadRequest(
            f"{where}: the data: URL says {declared} but the data is a {actual} image",
            param=param,
        )
    return {"type": "image", "data": data}


# A data: URL's type -> the format its bytes must have. A URL with no type
# (data:;base64,...) is taken for what its bytes are.
IMAGE_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WebP",
    "image/gif": "GIF",
}


def image_format(raw: bytes) -> str | None:
    """The image format its signature says (PNG, JPEG, WebP, GIF), or None."""
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if raw.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if raw.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WebP"
    return None


def _is_container(raw: bytes, mime: str) -> bool:
    """The container's signature: an ISO BMFF box ('ftyp' first) or an EBML header."""
    if mime == "video/mp4":
        return raw[4:8] == b"ftyp"
    return raw[:4] == b"\x1a\x45\xdf\xa3"


def video_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """A video_url part: an inline mp4 or webm within the byte limit; the thinker decodes
    it (and refuses what is corrupt or longer than MAX_VIDEO_SECONDS)."""
    video = part.get("video_url")
    url = video.get("url") if isinstance(video, dict) else video
    where = f"{param}.video_url"
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(
            f"{where}: send the video inline as a data: URL "
            "(data:video/mp4;base64,...); the router fetches no URLs",
            param=param,
        )
    header, _, data = url.partition(",")
    mime = header.removeprefix("data:").split(";")[0].lower()
    if mime not in VIDEO_TYPES:
        raise BadRequest(
            f"{where}: only {' and '.join(VIDEO_TYPES)} are supported, got {shown(mime or 'none')}",
            param=param,
        )
    if not header.endswith(";base64"):
        raise BadRequest(f"{where}: the data: URL must be base64", param=param)
    if len(data) // 4 * 3 > MAX_VIDEO_BYTES + 3:
        raise BadRequest(f"{where}: video larger than {MAX_VIDEO_BYTES} bytes", param=param)
    raw = base64_data(data, where)
    if len(raw) > MAX_VIDEO_BYTES:
        raise BadRequest(f"{where}: video larger than {MAX_VIDEO_BYTES} bytes", param=param)
    if not _is_container(raw, mime):
        raise BadRequest(f"{where}: not a decodable {mime} file", param=param)
    return {"type": "video", "data": data}


def check_processor_kwargs(raw: object) -> dict[str, Any]:
    """mm_processor_kwargs the thinker's processor may be given: use_audio_in_video (bool)
    and fps (the video's sampling rate, 0 < fps <= 8)."""
    param = "mm_processor_kwargs"
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{param}: expected an object", param=param)
    unknown = sorted(set(raw) - set(PROCESSOR_KWARGS))
    if unknown:
        raise BadRequest(
            f"{param}: {', '.join(unknown)} not supported; "
            f"supported: {', '.join(PROCESSOR_KWARGS)}",
            param=param,
        )
    if "use_audio_in_video" in raw and not isinstance(raw["use_audio_in_video"], bool):
        raise BadRequest(f"{param}.use_audio_in_video: expected a boolean", param=param)
    fps = raw.get("fps")
    if "fps" in raw and (
        isinstance(fps, bool)
        or not isinstance(fps, (int, float))
        or not 0 < fps <= MAX_SAMPLING_FPS
    ):
        raise BadRequest(f"{param}.fps: must be in (0, {MAX_SAMPLING_FPS:g}]", param=param)
    return dict(raw)


def check_wav(raw: bytes, param: str) -> None:
    """The header of a PCM WAV clip: sample width, channels, rate and length."""
    try:
        with wave.open(io.BytesIO(raw)) as wav:
            width, channels = wav.getsampwidth(), wav.getnchannels()
            rate, frames = wav.getframerate(), wav.getnframes()
            first = wav.readframes(1)
    except (wave.Error, EOFError, struct.error, ValueError):
        raise BadRequest(f"{param}: not a decodable WAV file", param=param) from None
    if width not in WAV_SAMPLE_WIDTHS:
        raise BadRequest(
            f"{param}: WAV samples must be 8, 16, 24 or 32-bit PCM, got {8 * width}-bit",
            param=param,
        )
    if channels < 1 or rate < 1:
        raise BadRequest(f"{param}: the WAV header has no channels or no rate", param=param)
    if len(first) < width * channels:
        raise BadRequest(f"{param}: the WAV file holds no audio", param=param)
    if frames > MAX_AUDIO_SECONDS * rate:
        raise BadRequest(
            f"{param}: audio longer than {MAX_AUDIO_SECONDS}s ({frames / rate:.0f}s)", param=param
        )


def audio_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    clip = part.get("input_audio")
    if not isinstance(clip, dict):
        raise BadRequest(f"{param}.input_audio: expected {{data, format}}", param=param)
    if clip.get("format") != "wav":
        raise BadRequest(
            f"{param}.input_audio.format: only wav is supported, got {shown(clip.get('format'))}",
            param=param,
        )
    where = f"{param}.input_audio.data"
    check_wav(base64_data(clip.get("data"), where), where)
    return {"type": "audio", "data": clip["data"]}


def check_sampling(values: dict[str, Any], prefix: str = "") -> None:
    """Values the spec's ranges let through but no engine can compute with: NaN and
    infinities, and positive values so small they round to zero."""

    def refuse(key: str, rule: str) -> BadRequest:
        where = f"{prefix}.{key}" if prefix else key
        return BadRequest(f"{where}: {rule}", param=where)

    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise refuse(key, "must be a finite number")
    temperature = values.get("temperature")
    if temperature is not None and 0 < temperature < MIN_POSITIVE_SAMPLING:
        raise refuse("temperature", f"must be 0 (greedy) or at least {MIN_POSITIVE_SAMPLING:g}")
    for key in POSITIVE_SAMPLING:
        value = values.get(key)
        if value is not None and value < MIN_POSITIVE_SAMPLING:
            raise refuse(key, f"must be at least {MIN_POSITIVE_SAMPLING:g}")


def check_token_range(
    values: dict[str, Any], prefix: str = "", in_entry: bool = True, top_level: str = ""
) -> None:
    """min_tokens at most max_tokens, where both are known (a stage's spec defaults
    merged with the request's values): the stage would refuse it. The field the request
    set is named: its sampling_params_list entry (prefix) when in_entry, else the
    top-level field (max_tokens) that came under the spec's min_tokens."""
    low, high = values.get("min_tokens"), values.get("max_tokens")
    if low is None or high is None or low <= high:
        return
    if in_entry or not top_level:
        where = f"{prefix}.min_tokens" if prefix else "min_tokens"
        raise BadRequest(f"{where}: must be at most max_tokens ({high}), got {low}", param=where)
    raise BadRequest(
        f"{top_level}: must be at least the stage's min_tokens ({low}), got {high}",
        param=top_level,
    )


EDIT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MAX_EDIT_IMAGE_BYTES = 16 * 1024 * 1024
EDIT_IMAGE_SIDE = 4096
MAX_EDIT_IMAGE_PIXELS = EDIT_IMAGE_SIDE * EDIT_IMAGE_SIDE


def check_edit_image(raw: bytes, param: str = "image") -> tuple[int, int]:
    """(width, height) from the image's header: the format and the pixel count are
    checked here; the worker decodes the pixels."""
    if len(raw) > MAX_EDIT_IMAGE_BYTES:
        raise BadRequest(f"{param}: larger than {MAX_EDIT_IMAGE_BYTES} bytes", param=param)
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # PIL only warns below its own bomb limit; a warning is a refusal here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                kind, (width, height) = image.format, image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # PIL's own bomb limits sit above ours: the image is too large, not malformed.
        raise BadRequest(
            f"{param}: the image is over the limit of {MAX_EDIT_IMAGE_PIXELS} pixels "
            f"({EDIT_IMAGE_SIDE}x{EDIT_IMAGE_SIDE})",
            param=param,
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise BadRequest(f"{param}: not a PNG, JPEG or WebP image", param=param) from None
    if kind not in EDIT_IMAGE_FORMATS:
        raise BadRequest(f"{param}: must be PNG, JPEG or WebP, got {kind}", param=param)
    if width < 1 or height < 1 or width * height > MAX_EDIT_IMAGE_PIXELS:
        raise BadRequest(
            f"{param}: {width}x{height} is over the limit of {MAX_EDIT_IMAGE_PIXELS} pixels "
            f"({EDIT_IMAGE_SIDE}x{EDIT_IMAGE_SIDE})",
            param=param,
        )
    return width, height
