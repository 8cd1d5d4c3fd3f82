"""`omnipipe serve|render TARGET` never guesses: a missing path is an error at once with
no network, only Hub-shaped ids reach the Hub, HF_HUB_OFFLINE is honoured, and no error
quotes a file that is not a pipeline. `--port` is a port, and a taken one is refused
before anything starts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import from_model
from omnipipe.cli import main

SECRET = "sk-live-DO-NOT-ECHO-4242"


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every Hub lookup instead of making it."""
    asked: list[str] = []

    def refuse(repo_id: str, filename: str) -> None:
        asked.append(repo_id)
        raise AssertionError(f"looked up {repo_id} on the Hub")

    monkeypatch.setattr(from_model, "_read_hub", refuse)
    return asked


@pytest.mark.parametrize(
    "target",
    [
        "nope.yaml",
        "nope.yml",
        "configs/nope.yaml",
        "NOPE.YAML",
        "./nope",
        "../models/nope",
        "~/nope-model",
        "/abs/path/to/model",
        "a/b/c",
        "org/model/",
        "weird name/with spaces",
        "nope",
        "nope.txt",
        "nope.yaml.bak",
    ],
)
@pytest.mark.parametrize("command", ["serve", "render"])
def test_a_missing_path_is_an_error_at_once_with_no_network(
    command: str,
    target: str,
    no_hub: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    started, cpu = time.monotonic(), time.thread_time()
    assert main([command, target]) == 2
    # Little work (CPU time, which load does not stretch) and no wait on a network (the
    # Hub's retries took seconds each: 16 lookups were 23 s).
    assert time.thread_time() - cpu < 1.0
    assert time.monotonic() - started < 5.0
    assert no_hub == []
    err = capsys.readouterr().err
    assert f"{target}: neither a pipeline file nor a model directory: no such file" in err


@pytest.mark.parametrize(
    ("name", "hub"),
    [
        ("Qwen/Qwen2.5-Omni-7B", True),
        ("ByteDance-Seed/BAGEL-7B-MoT", True),
        ("gpt2", False),  # the Hub's legacy ids without an owner are not looked up
        ("nope.txt", False),
        ("org/model.yaml", False),
        ("org/model.git", False),
        ("org--x/model", False),
        ("org/../model", False),
        ("/org/model", False),
        ("org/model/extra", False),
        ("-org/model", False),
        ("org/" + "x" * 100, False),
        ("", False),
    ],
)
def test_only_hub_shaped_ids_are_hub_ids(name: str, hub: bool) -> None:
    assert from_model.is_hub_id(name) is hub


def test_a_hub_id_is_looked_up(no_hub: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match="looked up"):
        main(["render", "Qwen/Qwen2.5-Omni-7B"])
    assert no_hub == ["Qwen/Qwen2.5-Omni-7B"]


def test_hf_hub_offline_is_honoured_when_set_after_import(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; omnipipe reads it per call
    and asks the cache only."""
    import huggingface_hub

    calls: list[dict[str, Any]] = []

    def download(repo_id: str, filename: str, **kwargs: Any) -> str:
        calls.append(kwargs)
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["serve", "Qwen/Qwen2.5-Omni-7B"]) == 2
    assert calls == [{"local_files_only": True}]
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE is set" in err
    assert "local cache" in err


@pytest.mark.parametrize(
    "content",
    [
        f"API_KEY={SECRET}\n",
        f"apiKey: {SECRET}\nregion: x\n",
        f"- {SECRET}\n",
        f"key: [unclosed {SECRET}\n",
        f"{{'a': 1, {SECRET}",
        f"kind: Secret\ndata: {{token: {SECRET}}}\n",
        f"kind: OmniPipeline\nmetadata: {{name: {SECRET}}}\nspec: {{}}\n",
    ],
    ids=["env", "mapping", "list", "broken-yaml", "broken-flow", "other-kind", "bad-name"],
)
@pytest.mark.parametrize("command", ["serve", "render"])
def test_an_error_never_quotes_a_file_that_is_not_a_pipeline(
    command: str, content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "secrets.env"
    path.write_text(content)
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    assert SECRET not in err
    assert "DO-NOT-ECHO" not in err


def test_a_binary_or_huge_file_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + SECRET.encode())
    assert main(["serve", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "not a text file" in err
    assert SECRET not in err
    huge = tmp_path / "huge.yaml"
    huge.write_text("a: 1\n" * 300_000)
    assert main(["serve", str(huge)]) == 2
    assert "larger than 1048576 bytes" in capsys.readouterr().err
