"""Video input: the router's cheap checks (type, size, signature, processor kwargs) and the
thinker's PyAV decoding (Qwen's frame sampling, the audio track, the bounds on length,
size and memory). Each refusal names its limit."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import pytest

from omnipipe.router.api.inputs import MAX_VIDEO_BYTES, check_processor_kwargs, video_part
from omnipipe.router.api.messages import thinker_messages
from omnipipe.router.errors import BadRequest
from omnipipe.stagekit.chat_media import processor_options
from omnipipe.stagekit.stage import StageInputError
from omnipipe.stagekit.video import (
    VIDEO_MIN_PIXELS,
    VIDEO_TOTAL_PIXELS,
    VideoLimits,
    decode_video,
    frame_count,
    frame_size,
)
from tests.videos import b64, data_url, make_video

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_video()


def part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


# ---- router -----------------------------------------------------------------------------


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_the_router_passes_mp4_and_webm_on(container: str) -> None:
    raw = make_video(seconds=1, container=container, audio=False)
    assert video_part(part(data_url(raw, container)), "p") == {"type": "video", "data": b64(raw)}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/clip.mp4", "inline as a data: URL"),
        ("data:video/quicktime;base64,AAAA", "only video/mp4 and video/webm"),
        ("data:video/mp4,AAAA", "must be base64"),
        ("data:video/mp4;base64,%%%", "not valid base64"),
        ("data:video/mp4;base64," + b64(b"this is not a video at all"), "not a decodable"),
        ("data:video/webm;base64," + b64(make_video(1, audio=False)), "not a decodable"),
        ("data:video/mp4;base64," + "A" * (MAX_VIDEO_BYTES // 3 * 4 + 8), "larger than"),
    ],
    ids=["url", "type", "not-base64-url", "bad-base64", "garbage", "mp4-as-webm", "oversized"],
)
def test_the_router_refuses_bad_video_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as refused:
        video_part(part(url), "messages[0].content[0]")
    assert refused.value.status == 400


def test_the_router_takes_one_video_per_request(clip: bytes) -> None:
    messages = [{"role": "user", "content": [part(data_url(clip)), part(data_url(clip))]}]
    with pytest.raises(BadRequest, match="at most 1 video"):
        thinker_messages(messages)
    one = thinker_messages([{"role": "user", "content": [part(data_url(clip))]}])
    assert one[0]["content"] == [{"type": "video", "data": b64(clip)}]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_pixels": 10**9}, "max_pixels not supported; supported: use_audio_in_video, fps"),
        ({"use_audio_in_video": "yes"}, "boolean"),
        ({"fps": 0}, "fps"),
        ({"fps": 100}, "fps"),
        ({"fps": True}, "fps"),
    ],
)
def test_processor_kwargs_are_checked_by_both(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        check_processor_kwargs(kwargs)
    with pytest.raises(StageInputError):
        processor_options(kwargs)


def test_good_processor_kwargs_pass_through() -> None:
    kwargs = {"use_audio_in_video": True, "fps": 1}
    assert check_processor_kwargs(kwargs) == kwargs
    assert processor_options(kwargs) == {"use_audio_in_video": True, "fps": 1.0}


# ---- sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "seconds", "fps", "expected"),
    [
        (20, 2.0, 2.0, 4),  # 2 frames a second
        (300, 30.0, 2.0, 60),
        (10, 1.0, 2.0, 4),  # at least 4
        (3, 1.0, 2.0, 2),  # never more than the clip has, in pairs
        (1, 0.1, 2.0, 2),  # one frame, kept twice
        (9000, 300.0, 8.0, 768),  # at most 768
        (50, 5.0, 1.0, 4),  # 5 frames round to a pair count as Python's round() does: 4
    ],
)
def test_frame_count_follows_qwen_sampling(
    total: int, seconds: float, fps: float, expected: int
) -> None:
    assert frame_count(total, seconds, VideoLimits(fps=fps)) == expected


def test_frames_are_scaled_down_to_the_budget_never_up() -> None:
    limits = VideoLimits()
    assert frame_size(64, 48, 4, limits) == (64, 48)
    width, height = frame_size(3840, 2160, 4, limits)
    assert width * height <= limits.max_pixels
    assert abs(width / height - 16 / 9) < 0.02
    # Many frames share the clip's total budget, down to Qwen's per-frame floor.
    width, height = frame_size(1920, 1080, 768, limits)
    assert width * height <= max(VIDEO_TOTAL_PIXELS / 768 * 2, VIDEO_MIN_PIXELS * 1.05)


# ---- decoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_a_clip_decodes_to_sampled_frames_and_its_audio(container: str) -> None:
    raw = make_video(seconds=2, fps=10, container=container)
    video = decode_video(b64(raw), "v", VideoLimits(), audio_rate=16000)
    assert video.frames.shape == (4, 48, 64, 3)
    assert video.fps == pytest.approx(2.0)
    assert video.seconds == pytest.approx(2.0)
    # The frames are the ones sampled: frame i has red (i * 20) % 255 (within the codec's
    # loss); indices 0, 6, 13, 19 of 20.
    reds = [int(f[..., 0].mean()) for f in video.frames]
    assert all(abs(r - (i * 20) % 255) < 12 for r, i in zip(reds, (0, 6, 13, 19), strict=True))
    assert video.audio is not None
    assert abs(len(video.audio) - 32000) < 2000  # the codec pads a frame or two
    assert 0.2 < float(abs(video.audio).max()) < 0.4
    assert decode_video(b64(raw), "v", VideoLimits()).audio is None


def test_too_long_corrupt_oversized_and_silent_videos_say_why(clip: bytes) -> None:
    with pytest.raises(StageInputError, match="longer than 1s"):
        decode_video(b64(clip), "v", VideoLimits(max_seconds=1))
    with pytest.raises(StageInputError, match="larger than 1000 bytes"):
        decode_video(b64(clip), "v", VideoLimits(max_bytes=1000))
    with pytest.raises(StageInputError, match="not a decodable video"):
        decode_video(b64(b"\0\0\0\x18ftypmp42" + b"\0" * 500), "v", VideoLimits())
    silent = make_video(audio=False)
    with pytest.raises(StageInputError, match="no audio track"):
        decode_video(b64(silent), "v", VideoLimits(), audio_rate=16000)


def test_a_clip_cut_anywhere_is_decoded_or_refused_cleanly(clip: bytes) -> None:
    """No cut raises anything but the input error; what decodes is whole frame pairs."""
    refused = 0
    for length in [*range(0, len(clip), max(1, len(clip) // 40)), len(clip)]:
        try:
            video = decode_video(b64(clip[:length]) or "=", "v", VideoLimits())
        except StageInputError:
            refused += 1
            continue
        assert video.frames.shape[0] % 2 == 0
        assert video.frames.shape[1:] == (48, 64, 3)
    assert refused > 0


def test_a_realistic_clip_stays_within_the_bounds() -> None:
    """30 s of 640x360 at 30 frames/s (900 frames, 622 MB as RGB at full size): Qwen's 2
    frames/s keep 60, and at most max_frames within the pixel budget when those are
    tighter; the decoder never holds more than the kept frames."""
    raw = make_video(seconds=30, width=640, height=360, fps=30)
    assert len(raw) < 4 * 1024 * 1024
    tracemalloc.start()
    try:
        video = decode_video(b64(raw), "v", VideoLimits(), audio_rate=16000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert video.frames.shape == (60, 360, 640, 3)
    kept = video.frames.nbytes  # 41 MB; the stacking copies them once
    assert peak < 2.2 * kept + 8 * 1024 * 1024
    assert video.audio is not None
    assert abs(len(video.audio) / 16000 - 30) < 0.2
    tight = VideoLimits(fps=8, max_frames=16, max_pixels=VIDEO_MIN_PIXELS, total_pixels=10**6)
    small = decode_video(b64(raw), "v", tight)
    assert small.frames.shape[0] == 16
    assert small.fps == pytest.approx(16 / 30)
    height, width = small.frames.shape[1:3]
    assert width * height <= VIDEO_MIN_PIXELS * 1.05
    assert abs(width / height - 640 / 360) < 0.05


def test_frames_past_the_count_or_the_rate_are_refused_before_decoding() -> None:
    many = make_video(seconds=20, width=16, height=16, fps=10, audio=False)  # 200 frames
    with pytest.raises(StageInputError, match="video of more than 100 frames"):
        decode_video(b64(many), "v", VideoLimits(max_source_frames=100))
    packed = make_video(seconds=0.2, width=16, height=16, fps=5000, audio=False)
    with pytest.raises(StageInputError, match=r"1000 frames in 0\.20s, more than 240 frames a"):
        decode_video(b64(packed), "v", VideoLimits())


def test_frames_times_their_size_past_the_work_limit_are_refused_before_decoding() -> None:
    """Each frame within the size limit and the count within its own: their product, the
    decoder's work, is bounded too (an 8K clip of 18,000 frames took 219 s). The limit is
    lowered to a clip a test encodes quickly; the refusal decodes nothing."""
    clip = b64(make_video(seconds=10, width=320, height=240, fps=30, audio=False))
    work = 300 * 320 * 240
    started = time.perf_counter()
    with pytest.raises(
        StageInputError,
        match=f"decoding 300 frames of 320x240 is {work} pixels of work, past the limit of "
        f"{work - 1} ",
    ):
        decode_video(clip, "v", VideoLimits(max_decode_pixels=work - 1))
    refused = time.perf_counter() - started
    started = time.perf_counter()
    decode_video(clip, "v", VideoLimits(max_decode_pixels=work))
    decoded = time.perf_counter() - started
    assert refused < decoded, (refused, decoded)
    assert VideoLimits().max_decode_pixels < 18_000 * 7680 * 4320 // 100


def test_every_decoded_frame_is_held_to_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose header says 64x48 switches to 128x96 at a keyframe (two MPEG-TS
    clips back to back, as a hostile client would splice them): the frame is refused as
    it is decoded, though the header passed. The limit is lowered to 64x48 to show it."""
    import omnipipe.stagekit.video as video

    spliced = ts_clip(64, 48, first_pts=0) + ts_clip(128, 96, first_pts=10)
    monkeypatch.setattr(video, "MAX_SOURCE_PIXELS", 64 * 48)
    with pytest.raises(StageInputError, match="frame 10 is 128x96, larger than 3072 pixels"):
        decode_video(b64(spliced), "v", VideoLimits())
    small = ts_clip(64, 48, first_pts=0)
    assert decode_video(b64(small), "v", VideoLimits()).frames.shape[1:] == (48, 64, 3)


def ts_clip(width: int, height: int, first_pts: int, frames: int = 10) -> bytes:
    import io

    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mpegts") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            image = np.full((height, width, 3), 40 * i % 255, np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = first_pts + i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()
