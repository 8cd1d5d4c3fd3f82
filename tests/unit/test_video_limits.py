"""A chat stage's video budget as its model allows it: maxVideoFrames, when the spec leaves
it unset, is the tighter of 768 and the sampled frames that fit the context at their
smallest token cost, refused before any frame is decoded; a video's sound track, when
use_audio_in_video is set, is a clip of the request's audio budget, charged from its
demuxed packets before it is decoded. Checked on the tiny models' real processors."""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pytest

from omnipipe.api.spec import Role
from omnipipe.api.stage_spec import MediaLimits
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.transformers.thinker import ThinkerStage
from omnipipe.stagekit import video as video_module
from omnipipe.stagekit.chat_media import processor_media, smallest_video_patch
from omnipipe.stagekit.media_limits import effective_media
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.stagekit.video import VideoLimits, decode_video
from tests.unit.test_media_budget import audio, wav
from tests.unit.test_media_limits import processor
from tests.unit.test_omni_stages import spec
from tests.videos import b64, make_video

pytestmark = pytest.mark.timeout(300)
LOGGER = "omnipipe.stagekit.media_limits"


@pytest.fixture(scope="module")
def tiny25() -> Any:
    return processor("tiny://qwen2.5-omni")


@pytest.fixture(scope="module")
def stage() -> ThinkerStage:
    """tiny://qwen2.5-omni's thinker with a context of 1024 tokens."""
    short = spec("thinker", Role.THINKER, engine_args={"max_model_len": 1024})
    loaded = ThinkerStage(short, resolve_model_path("tiny://qwen2.5-omni"), "cpu")
    loaded.load()
    return loaded


def video_tokens(proc: Any, width: int, height: int, frames: int = 2) -> int:
    """What the processor really makes of a video of this many frames of this size."""
    clip = np.zeros((frames, height, width, 3), np.uint8)
    inputs = proc(text=[proc.video_token], videos=[clip], return_tensors="pt", fps=2.0)
    token = proc.tokenizer.convert_tokens_to_ids(proc.video_token)
    return int((inputs["input_ids"] == token).sum())


@pytest.mark.parametrize("model", ["tiny://qwen2.5-omni", "tiny://qwen3-omni"])
def test_the_smallest_video_patch_is_what_the_processor_makes(model: str) -> None:
    # Both processors call their video processor with 128 squares a frame at least (their
    # class defaults, over the checkpoint's own min_pixels): a 2:1 pair of frames makes
    # exactly that, a square pair no fewer (12 x 12 squares), four frames twice as many.
    proc = processor(model)
    assert smallest_video_patch(proc) == (128, 2)
    side = proc.video_processor.patch_size * proc.video_processor.merge_size
    assert video_tokens(proc, 2 * side, side) == 128
    assert video_tokens(proc, side, side) == 144
    assert video_tokens(proc, 2 * side, side, frames=4) == 256


def test_the_context_derives_max_video_frames(tiny25: Any) -> None:
    for context, frames in [(32768, 510), (4096, 62), (1024, 14), (256, 2)]:
        media = effective_media(MediaLimits(), processor_media(tiny25, context))
        assert media.limits.max_video_frames == frames  # (context - 1) // 128 pairs
        assert media.sources["max_video_frames"] == "context"
    # Past 768 the sampler's own cap is the tighter.
    media = effective_media(MediaLimits(), processor_media(tiny25, 131072))
    assert media.limits.max_video_frames == 768
    assert media.sources["max_video_frames"] == "default"


def test_the_thinker_logs_its_video_limit(stage: ThinkerStage) -> None:
    assert stage.media_limits.limits.max_video_frames == 14
    assert "maxVideoFrames 14 (context)" in stage.media_limits.summary()


def never_sized(*args: object) -> None:
    raise AssertionError("frames were sized for decoding")


def test_a_video_past_the_derived_frames_is_refused_before_any_frame_is_decoded(
    stage: ThinkerStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(video_module, "frame_size", never_sized)
    ten = make_video(seconds=10, audio=False)  # 20 frames at 2 a second
    job = StageJob({"messages": [{"role": "user", "content": [video(ten)]}]}, {})
    with pytest.raises(StageInputError) as caught:
        stage.prepare(job)
    assert caught.value.message == (
        "messages[0].content[0]: the video keeps 20 frames of its 10.0s once sampled, past "
        "the limit of 14 frames (send a shorter clip or a lower mm_processor_kwargs.fps) "
        "(maxVideoFrames, from the model's context: its 1024 tokens hold at most 14 frames "
        "of video at 64 tokens a frame or more)"
    )


def test_at_a_lower_fps_the_same_video_fits(stage: ThinkerStage) -> None:
    ten = make_video(seconds=10, audio=False)
    params = {
        "messages": [{"role": "user", "content": [video(ten)]}],
        "mm_processor_kwargs": {"fps": 1},
    }
    stage.prepare(StageJob(params, {}))  # 10 frames


def test_a_spec_value_overrides_the_derived_frames(caplog: pytest.LogCaptureFixture) -> None:
    short = spec("thinker", Role.THINKER, engine_args={"max_model_len": 1024}).model_copy(
        update={"media": MediaLimits(max_video_frames=20)}
    )
    given = ThinkerStage(short, resolve_model_path("tiny://qwen2.5-omni"), "cpu")
    with caplog.at_level(logging.INFO, LOGGER):
        given.load()
    assert given.media_limits.limits.max_video_frames == 20
    assert given.media_limits.sources["max_video_frames"] == "spec"
    assert (
        "media.maxVideoFrames 20 is more than the model takes (its context: its 1024 tokens "
        "hold at most 14 frames of video at 64 tokens a frame or more); the spec's value "
        "stands: a request past it cannot fit and is refused for its length, once decoded"
    ) in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    ten = make_video(seconds=10, audio=False)
    job = StageJob({"messages": [{"role": "user", "content": [video(ten)]}]}, {})
    given.prepare(job)  # 20 frames pass the spec's budget
    with pytest.raises(StageInputError, match="this model's context is 1024 tokens"):
        given.open(job)
    # Under the derived limit, a spec value is taken as it is.
    tight = short.model_copy(update={"media": MediaLimits(max_video_frames=4)})
    less = ThinkerStage(tight, resolve_model_path("tiny://qwen2.5-omni"), "cpu")
    less.load()
    assert less.media_limits.limits.max_video_frames == 4
    with pytest.raises(StageInputError, match=r"past the limit of 4 frames \(send"):
        less.prepare(StageJob({"messages": [{"role": "user", "content": [video(ten)]}]}, {}))


def video(raw: bytes) -> dict[str, Any]:
    return {"type": "video", "data": b64(raw)}


def with_sound(*parts: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": list(parts)}],
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }


def test_a_videos_sound_track_is_charged_to_the_audio_budget(stage: ThinkerStage) -> None:
    # Context 1024: 40 s of audio at 25 tokens a second. A 2 s video's track beside 37 s
    # of clips fits; beside 39 s it does not, and the track is named.
    assert stage.media_limits.limits.max_audio_seconds == 40
    clip = video(make_video(seconds=2))
    twenty = audio(wav(16000 * 20, 16000))
    stage.prepare(StageJob(with_sound(twenty, audio(wav(16000 * 17, 16000)), clip), {}))
    nineteen = audio(wav(16000 * 19, 16000))
    with pytest.raises(StageInputError) as caught:
        stage.prepare(StageJob(with_sound(twenty, nineteen, clip), {}))
    assert caught.value.message == (
        "messages[0].content[2] (its audio track): 2s takes the request's audio past its "
        "limit of 40s in all (maxAudioSeconds, from the model's context: its 1024 tokens "
        "hold at most 40s of audio at 25 tokens a second)"
    )
    # Without use_audio_in_video the track is not decoded, nor charged.
    plain = {"messages": [{"role": "user", "content": [twenty, nineteen, clip]}]}
    stage.prepare(StageJob(plain, {}))


def test_a_sound_track_past_what_the_processor_keeps_is_refused_before_decoding(
    tiny25: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiny://qwen2.5-omni's Whisper chunk is 30 s: a 31 s track (31 s of video at 0.25 fps
    # keeps 8 frames) is refused as a clip past it, before its frames or samples decode.
    media = effective_media(MediaLimits(), processor_media(tiny25, 32768))
    assert media.limits.max_audio_clip_seconds == 30
    budget = media.budget()
    long = b64(make_video(seconds=31, width=16, height=16, fps=1))
    with monkeypatch.context() as patched:
        patched.setattr(video_module, "frame_size", never_sized)
        with pytest.raises(StageInputError) as caught:
            decode_video(long, "v", VideoLimits(fps=0.25), 16000, budget)
    # 31 s and the encoder's priming samples.
    assert re.fullmatch(
        r"v \(its audio track\): the clip is 31\.\ds, past the limit of 30s a clip "
        r"\(maxAudioClipSeconds, from the model's processor: it keeps only the first 30s "
        r"of a clip\)",
        caught.value.message,
    )
    assert (budget.clips, budget.seconds) == (0, 0.0)
    # A shorter track is charged what its packets span, and decodes to about that.
    budget = media.budget()
    decoded = decode_video(b64(make_video(seconds=2)), "v", VideoLimits(), 16000, budget)
    assert budget.clips == 1
    assert 2.0 <= budget.seconds < 2.1
    assert decoded.audio is not None
    assert abs(len(decoded.audio) / 16000 - budget.seconds) < 0.1
