"""/v1/audio/voices on a voice-cloning pipeline (Qwen3-TTS): a voice uploaded to one router
is listed by another sharing its Redis, and by a router started afresh; speech that names
it reaches the talker as that clip (ref_audio, x_vector_only_mode); deleted, it is gone
everywhere. Bad uploads are 400s naming the field. The stages are fake workers
(tests/unit/test_router_results.py) and the store a real redis-server."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.local.video_store import start_redis
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings
from omnipipe.router.voice_store import VoiceStore
from tests.unit import test_router_results
from tests.unit.test_router_results import FakeWorker, results

pytestmark = pytest.mark.timeout(60)
serve_worker = test_router_results.serve_worker
PCM = b"\x01\x00" * 2400  # 0.1 s at 24 kHz


def tts(model: str = "tiny://qwen3-tts-base") -> ResolvedPipeline:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "tts"},
                "spec": {"model": model, "pipeline": "qwen3-tts"},
            }
        )
    )


def wav(seconds: float, rate: int = 24000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x10" * int(seconds * rate))
    return out.getvalue()


@contextmanager
def routers(
    tmp_path: Path, url: str, count: int = 1, **settings: Any
) -> Iterator[list[TestClient]]:
    """`count` routers of the pipeline over the fake workers at `url`, sharing one Redis
    (started for the first call of the test, found again by the later ones)."""
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in tts().stages}))
    store = (tmp_path / "store-url").read_text()
    config = RouterSettings(replicas_file=str(replicas), video_store=store, **settings)
    clients = [TestClient(build_app(tts(), config)) for _ in range(count)]
    for c in clients:
        c.__enter__()
    try:
        yield clients
    finally:
        for c in clients:
            c.__exit__(None, None, None)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[None]:
    server, url = start_redis(tmp_path / "redis")
    (tmp_path / "store-url").write_text(url)
    yield
    server.terminate()
    server.wait(10)


def upload(client: TestClient, name: str, clip: bytes, **fields: str) -> Any:
    return client.post(
        "/v1/audio/voices",
        data={"name": name, "consent": "true", **fields},
        files={"audio_sample": ("voice.wav", clip, "audio/wav")},
    )


@pytest.mark.usefixtures("redis")
def test_a_voice_uploaded_once_is_spoken_listed_and_deleted_across_routers(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"audio": base64.b64encode(PCM).decode(), "sample_rate": 24000}))
    url = serve_worker(worker)
    clip = wav(1.5)
    with routers(tmp_path, url, count=2) as (one, two):
        made = upload(one, "narrator", clip, ref_text="Hello there.")
        assert made.status_code == 200, made.text
        assert made.json() | {"created_at": 0} == {
            "object": "voice",
            "name": "narrator",
            "created_at": 0,
            "seconds": 1.5,
            "sample_rate": 24000,
            "ref_text": "Hello there.",
        }
        assert [v["name"] for v in two.get("/v1/audio/voices").json()["data"]] == ["narrator"]
        spoken = two.post(
            "/v1/audio/speech",
            json={"model": "tts", "input": "Hi.", "voice": "narrator", "response_format": "pcm"},
        )
        assert spoken.status_code == 200, spoken.text
        assert upload(two, "narrator", clip).status_code == 409  # one voice of a name
    # The clip goes to the talker alone, as the uploaded voice's (a model with a preset of
    # that name speaks its preset), never as the client's ref_audio.
    sent = [s for s in worker.submitted if s.request_id == worker.submitted[-1].request_id]
    talker = next(s for s in sent if s.params.get("input") == "Hi.")
    assert talker.params["voice_clip"] == "data:audio/wav;base64," + base64.b64encode(clip).decode()
    # With the transcript it was uploaded with: a Base model clones it in context.
    assert talker.params["voice_ref_text"] == "Hello there."
    assert "ref_audio" not in talker.params
    assert "ref_text" not in talker.params
    assert [s for s in sent if "voice_clip" in s.params] == [talker]
    # A router started afresh finds it; a delete through it is seen by the others.
    with routers(tmp_path, url, count=2) as (three, four):
        assert [v["name"] for v in three.get("/v1/audio/voices").json()["data"]] == ["narrator"]
        gone = three.delete("/v1/audio/voices/narrator")
        assert gone.json() == {"object": "voice.deleted", "name": "narrator", "deleted": True}
        assert four.get("/v1/audio/voices").json()["data"] == []
        assert four.delete("/v1/audio/voices/narrator").status_code == 404
        # A voice that is not kept is passed on as it is: the talker refuses what it
        # cannot speak.
        bye = {"model": "tts", "input": "Bye.", "voice": "narrator", "response_format": "pcm"}
        assert four.post("/v1/audio/speech", json=bye).status_code == 200
    last = next(s for s in worker.submitted if s.params.get("input") == "Bye.")
    assert "voice_clip" not in last.params


@pytest.mark.usefixtures("redis")
def test_bad_uploads_are_refused_by_field_and_the_count_is_bounded(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    url = serve_worker(FakeWorker(results({})))
    with routers(tmp_path, url, max_voices=1) as (client,):
        for param, response in [
            ("name", upload(client, "no spaces", wav(1))),
            ("name", upload(client, "x" * 65, wav(1))),
            ("consent", upload(client, "a", wav(1), consent="no")),
            ("audio_sample", upload(client, "a", b"RIFF....not a wav")),
            ("audio_sample", upload(client, "a", wav(61, rate=8000))),
            ("audio_sample", upload(client, "a", wav(0.5, rate=4000))),
            ("audio_sample", upload(client, "a", b"\x00" * ((10 << 20) + 1))),
        ]:
            assert response.status_code == 400, (param, response.text)
            assert response.json()["error"]["param"] == param, response.text
        # Multipart with text parts only (httpx sends data alone url-encoded).
        no_file = client.post(
            "/v1/audio/voices", files={"name": (None, "a"), "consent": (None, "true")}
        )
        assert no_file.json()["error"]["param"] == "audio_sample"
        url_encoded = client.post("/v1/audio/voices", data={"name": "a", "consent": "true"})
        assert "multipart/form-data" in url_encoded.json()["error"]["message"]
        as_json = client.post("/v1/audio/voices", json={"name": "a"})
        assert as_json.status_code == 400
        assert upload(client, "first", wav(1)).status_code == 200
        full = upload(client, "second", wav(1))
        assert full.status_code == 400
        assert "at most 1 voices" in full.json()["error"]["message"]


def test_a_pipeline_that_does_not_clone_keeps_no_voices(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """Qwen-Image has no /v1/audio/voices: the route is not there."""
    url = serve_worker(FakeWorker(results({})))
    image = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "img"},
                "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
            }
        )
    )
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in image.stages}))
    config = RouterSettings(replicas_file=str(replicas), video_store="redis://127.0.0.1:1")
    with TestClient(build_app(image, config)) as client:
        assert client.get("/v1/audio/voices").status_code == 404


def test_speech_does_not_depend_on_the_voices_store(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """A store that does not answer (or was never there) leaves the voice as sent: the
    speech is made, not a 503."""
    worker = FakeWorker(results({"audio": base64.b64encode(PCM).decode(), "sample_rate": 24000}))
    url = serve_worker(worker)
    (tmp_path / "store-url").write_text("redis://127.0.0.1:1")  # nothing listens there
    with routers(tmp_path, url) as (client,):
        spoken = client.post(
            "/v1/audio/speech",
            json={"model": "tts", "input": "Hi.", "voice": "ryan", "response_format": "pcm"},
        )
        assert spoken.status_code == 200, spoken.text
        assert spoken.content == PCM
        assert client.get("/v1/audio/voices").status_code == 503


@pytest.mark.usefixtures("redis")
def test_the_listing_names_the_presets_the_stages_give_then_the_uploaded(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"audio": "", "sample_rate": 24000}), voices=["vivian", "ryan"])
    with routers(tmp_path, serve_worker(worker)) as [client]:
        assert upload(client, "narrator", wav(1.5)).status_code == 200
        assert upload(client, "vivian", wav(1.5)).status_code == 200  # a preset's name
        body = client.get("/v1/audio/voices").json()
    assert body["voices"] == ["vivian", "ryan", "narrator"]  # each stage asked, once each
    assert [(v["name"], v["preset"]) for v in body["data"]] == [
        ("vivian", True),
        ("ryan", True),
        ("narrator", False),
        ("vivian", False),
    ]
    assert [v["name"] for v in body["uploaded_voices"]] == ["narrator", "vivian"]


def made_prompt(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A talker's prompt for the clip: one that names the clip it was made of."""
    clip = base64.b64decode(body["clip"])
    return 200, {
        "stage": "talker",
        "prompt": {"format": 1, "of": len(clip), "text": body["ref_text"]},
    }


@pytest.mark.usefixtures("redis")
def test_a_voice_s_prompt_is_made_once_at_upload_and_sent_in_place_of_its_clip(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(
        results({"audio": base64.b64encode(PCM).decode(), "sample_rate": 24000}),
        voice_prompt=made_prompt,
    )
    url = serve_worker(worker)
    clip = wav(1.5)
    speak = {"model": "tts", "input": "Hi.", "voice": "narrator", "response_format": "pcm"}
    with routers(tmp_path, url, count=2) as (one, two):
        assert upload(one, "narrator", clip, ref_text="Hello there.").status_code == 200
        assert two.post("/v1/audio/speech", json=speak).status_code == 200
    with routers(tmp_path, url) as (three,):  # a router started afresh
        assert three.post("/v1/audio/speech", json=speak).status_code == 200
    assert worker.prompt_calls == [
        {"clip": base64.b64encode(clip).decode(), "ref_text": "Hello there."}
    ]
    talkers = [s for s in worker.submitted if s.params.get("input") == "Hi."]
    assert len(talkers) == 2
    for talker in talkers:
        assert talker.params["voice_prompt"] == {
            "format": 1,
            "of": len(clip),
            "text": "Hello there.",
        }
        assert talker.params["voice_ref_text"] == "Hello there."
        assert "voice_clip" not in talker.params


@pytest.mark.usefixtures("redis")
def test_a_prompt_no_talker_could_make_at_upload_is_made_by_the_first_speech(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    answers = iter([(503, {"detail": "loading"}), (200, {"prompt": {"format": 1}})])
    worker = FakeWorker(
        results({"audio": base64.b64encode(PCM).decode(), "sample_rate": 24000}),
        voice_prompt=lambda body: next(answers),
    )
    url = serve_worker(worker)
    speak = {"model": "tts", "input": "Hi.", "voice": "narrator", "response_format": "pcm"}
    with routers(tmp_path, url, count=2) as (one, two):
        assert upload(one, "narrator", wav(1.5)).status_code == 200  # kept without one
        assert one.post("/v1/audio/speech", json=speak).status_code == 200
        assert two.post("/v1/audio/speech", json=speak).status_code == 200
    assert len(worker.prompt_calls) == 2  # the upload's, and the first speech's
    talkers = [s for s in worker.submitted if s.params.get("input") == "Hi."]
    assert [t.params["voice_prompt"] for t in talkers] == [{"format": 1}, {"format": 1}]
    assert all("voice_ref_text" not in t.params for t in talkers)  # uploaded without one


@pytest.mark.usefixtures("redis")
def test_a_clip_the_talker_refuses_is_not_kept(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    refusal = "ref_audio: the clip is 0.80 s; a voice's clip is at least 1 s"
    worker = FakeWorker(results({}), voice_prompt=lambda body: (400, {"detail": refusal}))
    with routers(tmp_path, serve_worker(worker)) as (client,):
        refused = upload(client, "narrator", wav(0.8))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "audio_sample"
        assert refused.json()["error"]["message"] == (
            "audio_sample: the clip is 0.80 s; a voice's clip is at least 1 s"
        )
        assert client.get("/v1/audio/voices").json()["data"] == []


async def test_a_late_prompt_is_kept_only_for_the_upload_it_was_made_of(tmp_path: Path) -> None:
    """A request that made a voice's prompt while that voice was deleted and another
    uploaded under its name does not give the new voice the old one's prompt; nor does it
    replace a prompt made meanwhile."""
    server, url = start_redis(tmp_path / "redis")
    store = VoiceStore(url, "ns", "tts", max_voices=4)
    try:
        await store.add("bob", b"old clip", {"name": "bob", "created_at": 1}, None)
        old = await store.voice("bob")
        assert old is not None
        assert await store.delete("bob")
        await store.add("bob", b"new clip", {"name": "bob", "created_at": 2}, None)
        assert not await store.set_prompt("bob", old, {"format": 1, "of": "old"})
        new = await store.voice("bob")
        assert new is not None
        assert new.prompt is None
        assert await store.set_prompt("bob", new, {"format": 1, "of": "new"})
        assert not await store.set_prompt("bob", new, {"format": 1, "of": "again"})
        kept = await store.voice("bob")
        assert kept is not None
        assert kept.prompt == {"format": 1, "of": "new"}
    finally:
        await store.close()
        server.terminate()
        server.wait(10)
