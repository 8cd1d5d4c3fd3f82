"""The Kubernetes product serves for real: the chart's operator (a pod) turns the examples
into pods that start from the built images, pass their probes, find each other through
the headless Services, and answer the openai client through the router's Service."""

from __future__ import annotations

import base64
import io
import sys
import time
import wave

import av
import numpy as np
import openai
import pytest
from PIL import Image

from tests.harness.cluster import REPO
from tests.harness.node import RealNode
from tests.realnode.conftest import (
    MUST_SPEAK,
    SPEAKING_SEED,
    apply_and_wait_ready,
    pods,
    router_url,
    wait_for,
)

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]


def test_the_operator_runs_as_a_pod_under_its_service_account(
    node: RealNode, operator: str
) -> None:
    (pod,) = pods(node, operator, "app.kubernetes.io/name=omnipipe")
    assert pod["spec"]["serviceAccountName"] == "omnipipe-operator"
    assert pod["spec"]["containers"][0]["image"] == "localhost/omnipipe/operator:dev"
    assert pod["status"]["phase"] == "Running"
    statuses = pod["status"]["containerStatuses"]
    assert all(s["ready"] for s in statuses), statuses
    assert pod["status"]["podIP"].startswith("10.88.0.")


def test_text_to_image_serves_a_1024_image(node: RealNode, operator: str, namespace: str) -> None:
    took = apply_and_wait_ready(
        node, namespace, REPO / "examples/tiny-text-to-image.yaml", "tiny-image"
    )
    print(f"[realnode] tiny-image: apply to Ready in {took:.1f} s", file=sys.stderr)
    stage_pods = pods(node, namespace, "omnipipe.io/pipeline=tiny-image,omnipipe.io/stage")
    assert sorted(p["metadata"]["labels"]["omnipipe.io/stage"] for p in stage_pods) == [
        "decode",
        "denoise",
        "encode",
    ]
    # Real processes in real containers, from the worker image, as its user.
    for p in stage_pods:
        assert p["spec"]["containers"][0]["image"] == "localhost/omnipipe/worker:dev"
        assert p["status"]["containerStatuses"][0]["started"] is True
        assert p["status"]["podIP"].startswith("10.88.0.")
    url = router_url(node, namespace, "tiny-image")
    started = time.monotonic()
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:
        r = client.images.generate(
            model="tiny-image",
            prompt="a lighthouse at dusk",
            size="1024x1024",
            extra_body={"num_inference_steps": 2},
        )
    print(
        f"[realnode] first 1024x1024 image {time.monotonic() - started:.1f} s after Ready, "
        f"{took + time.monotonic() - started:.1f} s after the apply",
        file=sys.stderr,
    )
    image = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json or "")))
    assert image.size == (1024, 1024)
    assert np.asarray(image).std() > 0, "a flat image: the stages did not run"


def png_of(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_an_edit_with_two_images_serves_through_the_router_service(
    node: RealNode, operator: str, namespace: str
) -> None:
    """Qwen-Image-Edit-Plus, a family added on the stage kit: its four stages as pods,
    both input images reaching them through the router's Service."""
    took = apply_and_wait_ready(
        node, namespace, REPO / "examples/tiny-image-edit-plus.yaml", "tiny-image-edit-plus"
    )
    print(f"[realnode] tiny-image-edit-plus: apply to Ready in {took:.1f} s", file=sys.stderr)
    stage_pods = pods(
        node, namespace, "omnipipe.io/pipeline=tiny-image-edit-plus,omnipipe.io/stage"
    )
    assert sorted(p["metadata"]["labels"]["omnipipe.io/stage"] for p in stage_pods) == [
        "decode",
        "denoise",
        "encode",
        "encode-image",
    ]
    url = router_url(node, namespace, "tiny-image-edit-plus")
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:

        def edit(second: bytes) -> Image.Image:
            r = client.images.edit(
                model="tiny-image-edit-plus",
                image=[
                    ("cat.png", png_of(80, 48, (200, 30, 30)), "image/png"),
                    ("sofa.png", second, "image/png"),
                ],
                prompt="the cat of picture 1 on the sofa of picture 2",
                size="64x96",  # type: ignore[arg-type]
                extra_body={"num_inference_steps": 2, "seed": 5},
            )
            return Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json or "")))

        first = edit(png_of(48, 64, (30, 30, 200)))
        other = edit(png_of(64, 64, (30, 200, 30)))
    assert first.size == other.size == (64, 96)
    assert np.asarray(first).std() > 0, "a flat image: the stages did not run"
    assert first.tobytes() != other.tobytes(), "the second image did not reach the stages"


def test_omni_streams_text_then_audio_and_speaks(
    node: RealNode, operator: str, namespace: str
) -> None:
    took = apply_and_wait_ready(node, namespace, REPO / "examples/tiny-omni.yaml", "tiny-omni")
    print(f"[realnode] tiny-omni: apply to Ready in {took:.1f} s", file=sys.stderr)
    thinker = pods(node, namespace, "omnipipe.io/pipeline=tiny-omni,omnipipe.io/stage=thinker")
    assert len(thinker) == 1
    url = router_url(node, namespace, "tiny-omni")
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:
        kinds: list[str] = []
        text, pcm = "", b""
        stream = client.chat.completions.create(
            model="tiny-omni",
            messages=[{"role": "user", "content": "hello"}],
            modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "pcm16"},
            stream=True,
            seed=SPEAKING_SEED,
        )
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    kinds.append("text")
                    text += choice.delta.content
                audio = getattr(choice.delta, "audio", None)
                if audio is not None and audio.data:
                    kinds.append("audio")
                    pcm += base64.b64decode(audio.data)
        assert "text" in kinds, kinds
        assert "audio" in kinds, kinds
        assert kinds.index("text") < kinds.index("audio"), kinds
        assert text
        assert np.frombuffer(pcm, "<i2").any(), "no audio, or silent audio"

        seeded = {**MUST_SPEAK, "seed": SPEAKING_SEED}
        speech = client.audio.speech.create(
            model="tiny-omni", input="hello world", voice="Ethan", extra_body=seeded
        )
        with wave.open(io.BytesIO(speech.content)) as w:
            assert (w.getnchannels(), w.getframerate()) == (1, 24000)
            wav = np.frombuffer(w.readframes(w.getnframes()), "<i2")
            assert wav.any()
        # The same speech as an MP3, encoded by the code2wav pod (its image's PyAV).
        mp3 = client.audio.speech.create(
            model="tiny-omni",
            input="hello world",
            voice="Ethan",
            response_format="mp3",
            extra_body=seeded,
        )
        with av.open(io.BytesIO(mp3.content)) as container:
            stream = container.streams.audio[0]
            assert stream.codec_context.name.startswith("mp3")  # the decoder: mp3float
            samples = sum(frame.samples for frame in container.decode(stream))
        # The same seed: the same length, give or take under two MP3 frames (2 x 1152
        # samples): LAME's priming, which a streamed MP3 has no header to drop, and the
        # last frame's padding (seen: 1632 samples more).
        assert abs(samples - len(wav)) < 2 * 1152, (samples, len(wav))


METRIC_SCRIPT = (
    "import urllib.request as r; print(r.urlopen('http://127.0.0.1:8100/metrics').read().decode())"
)


def test_a_colocated_omni_runs_in_one_pod_and_hands_off_inside_it(
    node: RealNode, operator: str, namespace: str
) -> None:
    """spec.placement: colocated: one Deployment, one pod, every stage's Service resolving
    to it; the thinker's states reach the talker, and its codes code2wav, by reference."""
    name = "tiny-omni-colocated"
    took = apply_and_wait_ready(node, namespace, REPO / f"examples/{name}.yaml", name)
    print(f"[realnode] {name}: apply to Ready in {took:.1f} s", file=sys.stderr)
    (pod,) = pods(node, namespace, f"omnipipe.io/pipeline={name},omnipipe.io/stage")
    assert pod["metadata"]["labels"]["omnipipe.io/stage"] == "all"
    assert pod["spec"]["containers"][0]["args"][-4:] == [
        "--group",
        "all",
        "--transfer-ports",
        "8101,8102,8103",
    ]
    url = router_url(node, namespace, name)
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:
        r = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hello"}],
            modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "wav"},
            seed=SPEAKING_SEED,
        )
    message = r.choices[0].message
    assert message.content
    assert message.audio is not None
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert w.getnframes() > 0
    metrics = node.kubectl(
        "exec", "-n", namespace, pod["metadata"]["name"], "--", "python3", "-c", METRIC_SCRIPT
    ).stdout
    local = {
        line.split('stage="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("omnipipe_transfer_local_handoffs_total{")
    }
    assert local["thinker"] > 0
    assert local["talker"] > 0


def test_deleting_the_pipeline_removes_every_child(
    node: RealNode, operator: str, namespace: str
) -> None:
    # The second apply of this example in the run: the node has the image unpacked.
    started = time.monotonic()
    took = apply_and_wait_ready(
        node, namespace, REPO / "examples/tiny-text-to-image.yaml", "tiny-image"
    )
    url = router_url(node, namespace, "tiny-image")
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:
        r = client.images.generate(model="tiny-image", prompt="a lighthouse", size="64x64")
        assert r.data[0].b64_json
    print(
        f"[realnode] tiny-image again: apply to Ready in {took:.1f} s, "
        f"apply to first answer in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    selector = "omnipipe.io/pipeline=tiny-image"
    assert pods(node, namespace, selector)
    node.kubectl(
        "delete",
        "-n",
        namespace,
        "-f",
        str(REPO / "examples/tiny-text-to-image.yaml"),
        "--wait=true",
        timeout=180,
    )

    def nothing_left() -> bool:
        kinds = "deployments,replicasets,services,configmaps,pods,endpointslices"
        left = node.kubectl("get", kinds, "-n", namespace, "-l", selector, "-o", "name").stdout
        return not left.strip()

    wait_for("every child of the pipeline to be gone", nothing_left, 180)
