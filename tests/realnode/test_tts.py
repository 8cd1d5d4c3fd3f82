"""Qwen3-TTS on the real node: its weights on a PersistentVolume (a hostPath volume of the
node, bound to the pipeline's claim: spec.weights source claim), the talker and code2wav
pods started from the built worker image, and the openai client getting speech through
the router's Service: a WAV that is the model authors' qwen-tts's own for the seed, and
an MP3 encoded by the code2wav pod."""

from __future__ import annotations

import io
import os
import shutil
import sys
import wave
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import yaml

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.harness.node import RealNode
from tests.harness.tts_reference import pcm_of, reference_outputs
from tests.realnode.conftest import apply_and_wait_ready, pods, router_url

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]
MODEL = "qwen3-tts-custom-voice"
NAME = "tiny-tts"
TEXT = "The train leaves at noon."
SPOKEN = {"seed": 42, "language": "english", "max_new_tokens": 30}


def weights_volume(node: RealNode, namespace: str, root: Path) -> str:
    """A PersistentVolume on the node's disk at root, bound to a claim of the namespace;
    the claim's name."""
    claim = "tts-weights"
    volume = f"{namespace}-tts-weights"
    docs = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(root), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    return claim


def test_qwen3_tts_speaks_from_weights_on_a_volume_through_the_router_service(
    node: RealNode, operator: str, namespace: str, tmp_path: Path
) -> None:
    # Made on the host through qwen-tts's own classes (its side environment, which the
    # worker image does not carry), then copied where the node's volume is.
    built = Path(resolve_model_path(f"tiny://{MODEL}"))
    root = tmp_path / "weights"
    shutil.copytree(built, root / MODEL)
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)
        for f in files:
            os.chmod(Path(directory) / f, 0o644)
    claim = weights_volume(node, namespace, root)
    manifest = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": NAME},
        "spec": {
            "model": f"tiny://{MODEL}",
            "pipeline": "qwen3-tts",
            "weights": {"source": "claim", "claimName": claim, "path": MODEL},
            # This tests serving through the Service, not the engine: the talker on
            # transformers (the vLLM talker, the default, is tests/e2e's and bench/tts.py's).
            "stages": [{"name": "talker", "engine": "transformers"}],
        },
    }
    try:
        took = apply_and_wait_ready(node, namespace, yaml.safe_dump(manifest), NAME)
        print(f"[realnode] {NAME}: apply to Ready in {took:.1f} s", file=sys.stderr)
        talker = pods(node, namespace, f"omnipipe.io/pipeline={NAME},omnipipe.io/stage=talker")
        assert len(talker) == 1
        mounted = {v["name"]: v for v in talker[0]["spec"]["volumes"]}
        assert mounted["weights"]["persistentVolumeClaim"]["claimName"] == claim
        url = router_url(node, namespace, NAME)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
            speech = c.audio.speech.create(
                model=NAME, input=TEXT, voice="vivian", extra_body=SPOKEN
            )
            mp3 = c.audio.speech.create(
                model=NAME, input=TEXT, voice="vivian", response_format="mp3", extra_body=SPOKEN
            )
    finally:
        node.kubectl("delete", "omnipipeline", NAME, "-n", namespace, "--wait=true")
        node.kubectl("delete", "persistentvolume", f"{namespace}-tts-weights", "--wait=false")
    case = {"text": TEXT, "speaker": "vivian", **SPOKEN}
    expected = reference_outputs({"realnode": (MODEL, case)})["realnode"]
    with wave.open(io.BytesIO(speech.content)) as w:
        assert (w.getnchannels(), w.getframerate()) == (1, 24000)
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert len(pcm) == len(expected["wav"])
    assert np.abs(pcm.astype(np.float64) - pcm_of(expected["wav"])).max() <= 1
    with av.open(io.BytesIO(mp3.content)) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name.startswith("mp3")
        samples = sum(frame.samples for frame in container.decode(stream))
    # LAME's priming and the last frame's padding: under two MP3 frames (test_serving.py).
    assert abs(samples - len(pcm)) < 2 * 1152, (samples, len(pcm))
