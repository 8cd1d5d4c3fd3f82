"""`omnipipe fetch MODEL DIR`: DIR appears whole or not at all, says what it holds, and a
failure names its reason."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnipipe.api.from_model import checkpoint_kinds
from omnipipe.checkpoints.fetch import COMPLETE, FetchError, fetch
from omnipipe.cli import main


@pytest.fixture(scope="module")
def fetched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fetch("tiny://qwen-image", tmp_path_factory.mktemp("models") / "qwen-image")


def test_a_fetched_model_is_complete_and_serveable(fetched: Path) -> None:
    held = json.loads((fetched / COMPLETE).read_text())
    assert held == {"model": "tiny://qwen-image", "revision": None}
    # `omnipipe serve DIR` reads it as the checkpoint it is.
    assert checkpoint_kinds(str(fetched)) == ["QwenImagePipeline"]
    assert not fetched.with_name(f".{fetched.name}.partial").exists()
    before = (fetched / "model_index.json").stat().st_mtime_ns
    assert fetch("tiny://qwen-image", fetched) == fetched  # already there: nothing to do
    assert (fetched / "model_index.json").stat().st_mtime_ns == before


def test_a_directory_holding_something_else_is_refused(fetched: Path, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="already holds tiny://qwen-image") as held:
        fetch("tiny://qwen2.5-omni", fetched)
    assert held.value.reason == "NotEmpty"
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(FetchError, match="not a completed fetch"):
        fetch("tiny://qwen-image", stranger)
    with pytest.raises(FetchError, match="already a local directory") as local:
        fetch(str(fetched), tmp_path / "copy")
    assert local.value.reason == "LocalPath"


def test_an_unreachable_hub_leaves_no_model_and_names_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    target = tmp_path / "models" / "qwen-image"
    assert main(["fetch", "Qwen/Qwen-Image", str(target)]) == 3
    err = capsys.readouterr().err
    assert "the Hugging Face Hub cannot be reached" in err
    assert err.rstrip().endswith("reason: Unreachable")
    assert not target.exists()
    assert main(["fetch", "tiny://nothing", str(target)]) == 3
    assert capsys.readouterr().err.rstrip().endswith("reason: UnknownModel")


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a real full disk (needs root, as CI's machine runs)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(volume)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", str(volume)], check=True)


def test_a_full_volume_is_no_space_and_leaves_no_model(small_volume: Path) -> None:
    target = small_volume / "qwen-image"
    with pytest.raises(FetchError, match="no space left") as full:
        fetch("tiny://qwen-image", target)  # 1.6 MiB
    assert full.value.reason == "NoSpace"
    assert not target.exists()


@pytest.mark.parametrize("model", ["nope.yaml", "nope", "gpt2", "org/model/extra", "a b/c"])
def test_a_name_that_is_no_hub_id_is_refused_with_no_network(
    model: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import huggingface_hub

    def download(*args: object, **kwargs: object) -> str:
        raise AssertionError(f"looked up {model} on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    target = tmp_path / "m"
    started, cpu = time.monotonic(), time.thread_time()
    assert main(["fetch", model, str(target)]) == 3
    # Little work (CPU time, which load does not stretch) and no wait on a network (the
    # Hub's retries took seconds each: 16 lookups were 23 s).
    assert time.thread_time() - cpu < 1.0
    assert time.monotonic() - started < 5.0
    err = capsys.readouterr().err
    assert "not a Hugging Face model id (owner/name)" in err
    assert err.rstrip().endswith("reason: UnknownModel")
    assert not target.exists()
