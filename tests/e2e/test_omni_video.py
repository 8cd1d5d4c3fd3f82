"""video_url through `omnipipe serve` (tiny Qwen2.5-Omni and Qwen3-Omni, thinker on vLLM)
with the official openai client: a small generated mp4 gets text and audio back, with the
video's sound (use_audio_in_video) and without; bad video is a 400 that says why."""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import openai
import pytest

from tests.e2e.omni_variants import AUDIO, MODEL, THINKER_TOKENS
from tests.videos import data_url, make_video

pytestmark = pytest.mark.timeout(300)


def video_messages(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "What happens in this video?"},
            ],
        }
    ]


@pytest.mark.parametrize("use_audio_in_video", [False, True], ids=["frames", "frames+sound"])
def test_a_video_gets_text_and_audio_back(
    omni_client: openai.OpenAI, use_audio_in_video: bool
) -> None:
    url = data_url(make_video(seconds=2, fps=10))
    plain = omni_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}]
    )
    r = omni_client.chat.completions.create(
        model=MODEL,
        modalities=["text", "audio"],
        audio=AUDIO,
        messages=video_messages(url),
        extra_body={"mm_processor_kwargs": {"use_audio_in_video": use_audio_in_video}},
    )
    assert r.usage is not None
    assert plain.usage is not None
    assert r.usage.completion_tokens == THINKER_TOKENS
    # The frames (and with use_audio_in_video, the sound) became placeholder tokens.
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 8
    message = r.choices[0].message
    assert message.audio is not None
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert w.getnframes() > 0
    if use_audio_in_video:
        without = omni_client.chat.completions.create(model=MODEL, messages=video_messages(url))
        assert without.usage is not None
        assert r.usage.prompt_tokens > without.usage.prompt_tokens


@pytest.mark.parametrize(
    ("url", "kwargs", "message"),
    [
        ("data:video/mp4;base64," + base64.b64encode(b"\0" * 64).decode(), {}, "not a decodable"),
        (data_url(make_video(audio=False)), {"use_audio_in_video": True}, "no audio track"),
        ("data:video/avi;base64,AAAA", {}, "only video/mp4 and video/webm"),
        (data_url(make_video(1)), {"fps": 50}, "fps"),
    ],
    ids=["corrupt", "silent", "type", "fps"],
)
def test_bad_video_is_a_400_that_says_why(
    omni_client: openai.OpenAI, url: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        omni_client.chat.completions.create(
            model=MODEL,
            messages=video_messages(url),
            extra_body={"mm_processor_kwargs": kwargs},
        )
