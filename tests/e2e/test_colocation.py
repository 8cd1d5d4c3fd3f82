"""spec.placement under `omnipipe serve`: a colocated group answers exactly as the same
stages in processes of their own, its stages hand off by reference (no socket), and the
group restarts as one process."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omnipipe.local.ports import free_port
from tests.e2e.conftest import REPO, Served, start_serve, stop_cleanly, wait_line

pytestmark = pytest.mark.timeout(600)
HELLO = [{"role": "user", "content": "hello"}]
AUDIO = {"voice": "Chelsie", "format": "wav"}
OMNI = REPO / "examples/tiny-omni.yaml"
OMNI_COLOCATED = REPO / "examples/tiny-omni-colocated.yaml"
IMAGE = REPO / "examples/tiny-text-to-image.yaml"
IMAGE_GROUPED = REPO / "examples/tiny-image-grouped.yaml"
LOCAL = "omnipipe_transfer_local_handoffs_total"
NETWORK_OUT = 'omnipipe_transfer_bytes_total{direction="out"'


def spoken(served: Served, seed: int) -> tuple[str, str]:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        r = c.chat.completions.create(
            model=c.models.list().data[0].id,
            modalities=["text", "audio"],
            audio=AUDIO,
            messages=HELLO,
            seed=seed,
        )
    message = r.choices[0].message
    assert message.content
    assert message.audio is not None
    return message.content, message.audio.data


def drawn(served: Served, seed: int) -> bytes:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        r = c.images.generate(
            model=c.models.list().data[0].id,
            prompt="a lighthouse",
            size="64x64",
            extra_body={"num_inference_steps": 2, "seed": seed},
        )
    return base64.b64decode(r.data[0].b64_json or "")


def series(served: Served, worker: str, name: str) -> dict[str, float]:
    """stage label -> value of `name` (a prefix of the sample line) in a worker's /metrics."""
    found: dict[str, float] = {}
    for line in served.metrics(worker).splitlines():
        if line.startswith(name) and 'stage="' in line:
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            found[stage] = found.get(stage, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


@pytest.fixture(scope="module")
def omni_alone() -> dict[int, tuple[str, str]]:
    """The answers of tiny-omni with a process per stage, the reference."""
    served = start_serve(OMNI)
    try:
        return {seed: spoken(served, seed) for seed in (7, 8)}
    finally:
        stop_cleanly(served)


@pytest.fixture(scope="module")
def omni_together() -> Iterator[Served]:
    served = start_serve(OMNI_COLOCATED)
    yield served
    stop_cleanly(served)


def test_one_process_runs_every_stage(omni_together: Served) -> None:
    assert sorted(omni_together.workers) == ["all-0", "router"]


def test_colocated_omni_says_and_speaks_what_disaggregated_does(
    omni_alone: dict[int, tuple[str, str]], omni_together: Served
) -> None:
    for seed, answer in omni_alone.items():
        assert spoken(omni_together, seed) == answer


def test_colocated_stages_hand_off_by_reference(omni_together: Served) -> None:
    before = series(omni_together, "all-0", LOCAL)
    spoken(omni_together, 9)
    after = series(omni_together, "all-0", LOCAL)
    # The thinker's hidden states to the talker, the talker's codes to code2wav.
    assert after["thinker"] > before.get("thinker", 0)
    assert after["talker"] > before.get("talker", 0)
    # Nothing crossed a socket between them.
    assert set(series(omni_together, "all-0", NETWORK_OUT).values()) == {0.0}


def test_the_groups_metrics_list_each_family_once(omni_together: Served) -> None:
    text = omni_together.metrics("all-0")
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    running = series(omni_together, "all-0", "omnipipe_stage_requests_running")
    assert set(running) == {"thinker", "talker", "code2wav"}


def test_a_killed_group_comes_back_whole(omni_together: Served) -> None:
    _, pid = omni_together.workers["all-0"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while omni_together.workers["all-0"][1] == pid:
        assert time.monotonic() < deadline, "".join(omni_together.output[-30:])
        time.sleep(0.5)
    # Ready again: the router takes requests for every stage once its /ready says so.
    while True:
        try:
            spoken(omni_together, 7)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline, "".join(omni_together.output[-30:])
            time.sleep(1)


def test_a_group_beside_a_lone_stage_draws_what_disaggregated_does(tmp_path: Path) -> None:
    alone = start_serve(IMAGE)
    try:
        reference = [drawn(alone, seed) for seed in (1, 2)]
    finally:
        stop_cleanly(alone)
    manifest = tmp_path / "grouped.yaml"
    manifest.write_text(IMAGE_GROUPED.read_text())
    grouped = start_serve(manifest)
    try:
        assert sorted(grouped.workers) == ["encode-0", "pixels-0", "router"]
        assert [drawn(grouped, seed) for seed in (1, 2)] == reference
        # The denoiser's latents to the decoder went by reference; the encoder's
        # embeddings crossed a socket to the group.
        assert series(grouped, "pixels-0", LOCAL)["denoise"] == 2
        assert series(grouped, "encode-0", NETWORK_OUT)["encode"] > 0

        # A change to one of the group's stages replaces the group, and only it.
        encoder_pid = grouped.workers["encode-0"][1]
        manifest.write_text(manifest.read_text() + "  stages:\n    - {name: decode, maxBatch: 2}\n")
        mark = len(grouped.output)
        grouped.proc.send_signal(signal.SIGHUP)
        wait_line(grouped, "omnipipe: reloaded", mark)
        assert "pixels-1" in grouped.workers
        assert grouped.workers["encode-0"][1] == encoder_pid
        assert drawn(grouped, 1) == reference[0]
    finally:
        stop_cleanly(grouped)


def test_a_stage_that_cannot_load_ends_its_group_naming_it(tmp_path: Path) -> None:
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(
        OMNI_COLOCATED.read_text().replace(
            "    - name: thinker\n", "    - name: thinker\n      engineArgs: {no_such_arg: 1}\n"
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnipipe.cli",
            "worker",
            "--pipeline",
            str(manifest),
            "--group",
            "all",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--transfer-ports",
            ",".join(str(free_port()) for _ in range(3)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMNIPIPE_WORKER_DRAIN_TIMEOUT_SECONDS": "5"},
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("omnipipe worker: group all: stage thinker: load failed"), last
    assert "no_such_arg" in last
