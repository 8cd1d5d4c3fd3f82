"""A chat request's media budget: images and clips are charged from their headers before
anything is decoded, and each refusal is a 400 that names its limit."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.router.api.audio import wav_bytes
from omnipipe.stagekit.media import MediaBudget, charge_media
from omnipipe.stagekit.stage import StageInputError


def png(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def wav(frames: int, rate: int) -> str:
    return base64.b64encode(wav_bytes(b"\x00\x01" * frames, rate)).decode()


def messages(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


def image(data: str) -> dict[str, Any]:
    return {"type": "image", "data": data}


def audio(data: str) -> dict[str, Any]:
    return {"type": "audio", "data": data}


def refusal(msgs: list[dict[str, Any]], limits: MediaLimits) -> StageInputError:
    with pytest.raises(StageInputError) as caught:
        charge_media(msgs, MediaBudget(limits))
    return caught.value


def test_images_past_the_total_pixels_are_refused_from_their_headers() -> None:
    limits = MediaLimits(max_image_pixels=2 * 40 * 40)
    charge_media(messages(image(png(40, 40)), image(png(40, 40))), MediaBudget(limits))
    err = refusal(messages(*[image(png(40, 40))] * 3), limits)
    assert err.message == (
        "messages[0].content[3]: 40x40 takes the request's images past their limit of "
        "3200 pixels in all"
    )
    assert err.param == "messages[0].content[3]"


def test_the_default_budget_refuses_six_8000_pixel_squares_before_decoding_any() -> None:
    big = png(8000, 8000)  # one colour: about 200 KB of PNG, 192 MB decoded
    err = refusal(messages(*[image(big)] * 6), MediaLimits())
    assert "past their limit of 64000000 pixels in all" in err.message
    assert err.message.startswith("messages[0].content[2]")  # the second image


def test_too_many_images_or_clips() -> None:
    err = refusal(messages(*[image(png(4, 4))] * 3), MediaLimits(max_images=2))
    assert err.message == "messages[0].content[3]: more than 2 images in one request"
    err = refusal(messages(*[audio(wav(8000, 8000))] * 3), MediaLimits(max_audio_clips=2))
    assert err.message == "messages[0].content[3]: more than 2 audio clips in one request"


def test_a_1_hz_clip_is_refused_before_it_is_resampled() -> None:
    err = refusal(messages(*[audio(wav(300, 1))] * 200), MediaLimits())
    assert err.message == ("messages[0].content[1]: sample rate 1 Hz is outside 8000 to 192000 Hz")
    err = refusal(messages(audio(wav(10, 384_000))), MediaLimits())
    assert "sample rate 384000 Hz is outside" in err.message


def test_audio_past_the_total_seconds_is_refused() -> None:
    limits = MediaLimits(max_audio_seconds=5)
    charge_media(
        messages(audio(wav(16000 * 2, 16000)), audio(wav(16000 * 3, 16000))), MediaBudget(limits)
    )
    err = refusal(messages(*[audio(wav(16000 * 2, 16000))] * 3), limits)
    assert err.message == (
        "messages[0].content[3]: 2s takes the request's audio past its limit of 5s in all"
    )


def test_malformed_messages_are_left_to_the_conversation_checks() -> None:
    for bad in (None, "text", [None], [{"role": "user", "content": [None, 3]}]):
        charge_media(bad, MediaBudget(MediaLimits()))


def test_limits_are_a_spec_field_with_bounds() -> None:
    from pydantic import ValidationError

    from omnipipe.api.stage_spec import Stage

    stage = Stage.model_validate({"name": "thinker", "media": {"maxImages": 2}})
    assert stage.media is not None
    assert stage.media.max_images == 2
    with pytest.raises(ValidationError, match="minSampleRate must be <="):
        MediaLimits.model_validate({"minSampleRate": 48000, "maxSampleRate": 16000})
