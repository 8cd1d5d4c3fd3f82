"""The router's side of chat and speech: message conversion, per-stage sampling, and
which stages a request needs."""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from pathlib import Path

import pytest

from omnipipe.api import load_file, resolve
from omnipipe.router.api.chat import ChatPlan, ChatRequest
from omnipipe.router.api.common import sampling_overrides
from omnipipe.router.api.messages import thinker_messages
from omnipipe.router.errors import BadRequest
from omnipipe.transfer import Mailbox, Message

REPO = Path(__file__).resolve().parents[2]
OMNI = resolve(load_file(REPO / "examples/tiny-omni.yaml"))
IMAGE = resolve(load_file(REPO / "examples/tiny-text-to-image.yaml"))


def wav_b64(frames: bytes = b"\x00\x01" * 160, width: int = 2, channels: int = 1) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(16000)
        w.writeframes(frames)
    return base64.b64encode(buffer.getvalue()).decode()


CLIP = wav_b64()
# A 1x1 PNG: the router reads an image's signature, not its pixels.
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
    )
).decode()


def test_openai_parts_become_thinker_parts() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "input_audio", "input_audio": {"data": CLIP, "format": "wav"}},
            ],
        },
    ]
    assert thinker_messages(messages) == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image", "data": PNG},
                {"type": "audio", "data": CLIP},
            ],
        },
    ]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "data: URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, "must be base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}, "base64"),
        ({"type": "input_audio", "input_audio": {"data": "aGk=", "format": "mp3"}}, "only wav"),
        ({"type": "input_audio"}, "expected"),
        ({"type": "video_url"}, r"content\[0\]\.video_url: send the video inline as a data: URL"),
        ({"type": "file", "file": {"file_id": "f"}}, "unsupported content part 'file'"),
    ],
)
def test_bad_parts_are_400_naming_the_part(part: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest, match=message) as err:
        thinker_messages([{"role": "user", "content": [part]}])
    assert err.value.param is not None
    assert err.value.param.startswith("messages[0].content[0]")


def test_sampling_overrides_by_position_or_name() -> None:
    assert sampling_overrides(OMNI, [None, {"top_k": 5}]) == {"talker": {"top_k": 5}}
    assert sampling_overrides(OMNI, {"code2wav": {"seed": 1}}) == {"code2wav": {"seed": 1}}
    for bad, match in (
        ([{}, {}, {}, {}], "4 entries"),
        ({"x": {}}, "no stage 'x'"),
        ({"thinker": {"maxTokens": 0}}, "greater than or equal to 1"),
        ({"thinker": {"bogus": 1}}, "bogus"),
    ):
        with pytest.raises(BadRequest, match=match):
            sampling_overrides(OMNI, bad)  # type: ignore[arg-type]


def test_chat_plan_runs_only_what_the_modalities_need() -> None:
    text = ChatPlan(
        OMNI, ChatRequest(model="tiny-omni", messages=[{"role": "user", "content": "hi"}])
    )
    assert text.emitters == {"thinker"}
    both = ChatPlan(
        OMNI,
        ChatRequest(
            model="tiny-omni",
            messages=[{"role": "user", "content": "hi"}],
            modalities=["text", "audio"],
            max_tokens=9,
            temperature=0.3,
        ),
    )
    assert both.emitters == {"thinker", "code2wav"}
    assert both.params["thinker"]["sampling"] == {"temperature": 0.3, "max_tokens": 9}
    assert both.params["thinker"]["audio"] is True
    with pytest.raises(BadRequest, match="pcm16"):
        ChatPlan(
            OMNI,
            ChatRequest(
                model="tiny-omni",
                messages=[{"role": "user", "content": "hi"}],
                modalities=["text", "audio"],
                stream=True,
            ),
        )
    with pytest.raises(BadRequest, match="does not serve chat"):
        ChatPlan(
            IMAGE, ChatRequest(model="tiny-image", messages=[{"role": "user", "content": "x"}])
        )


async def test_mailbox_drops_chunks_for_finished_requests() -> None:
    mailbox = Mailbox(per_request=1)
    await mailbox.put(Message("r1", "thinker", {}))
    blocked = asyncio.create_task(mailbox.put(Message("r1", "thinker", {}, chunk=1)))
    await asyncio.sleep(0.01)
    assert not blocked.done()  # the queue is full: back-pressure
    mailbox.discard("r1")  # the request ended here
    await asyncio.wait_for(blocked, 1)  # the blocked sender is released
    await asyncio.wait_for(mailbox.put(Message("r1", "thinker", {}, chunk=2)), 1)
    assert len(mailbox) == 0  # late chunks are dropped, not queued
