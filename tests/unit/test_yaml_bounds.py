"""Pipeline files are read with bounds: nested anchors that would expand a 1 KB file past
gigabytes, and nesting deeper than the parser goes, are refused at once with a message
(not a crash); anchors of ordinary size still work."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from omnipipe.api import ManifestError, load_file
from omnipipe.api.loading import load_pipeline
from omnipipe.api.yamlio import MAX_DEPTH, MAX_EXPANDED_NODES, ExpandsTooFar, load
from omnipipe.cli import main

HEAD = "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: b}\nspec:\n"


def laughs(levels: int) -> str:
    """Nine levels of ten aliases each: 10**9 strings once expanded, in under 500 bytes."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.fixture
def bomb(tmp_path: Path) -> Path:
    # Under engineArgs, which takes any mapping: validating it would copy 10**9 strings.
    text = HEAD + "  model: tiny://qwen-image\n  pipeline: qwen-image\n  stages:\n"
    text += "    - name: encode\n      engineArgs:\n"
    text += "".join(f"        {line}\n" for line in laughs(9).splitlines())
    assert len(text) < 1024
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    path = tmp_path / "deep.yaml"
    path.write_text(HEAD + "  x: " + "[" * 20_000 + "]" * 20_000 + "\n")
    return path


@pytest.mark.parametrize(
    ("which", "says"),
    [
        ("bomb", f"expand it past {MAX_EXPANDED_NODES} YAML nodes"),
        ("deep", f"nested deeper than {MAX_DEPTH} levels"),
    ],
)
def test_a_file_that_would_explode_is_refused_at_once_by_every_reader(
    which: str, says: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    path: Path = request.getfixturevalue(which)
    for read in (load_file, load_pipeline):
        started = time.monotonic()
        with pytest.raises(ManifestError, match=says):
            read(path)
        # Unbounded, the bomb takes minutes and gigabytes, the deep file a RecursionError.
        assert time.monotonic() - started < 5.0
    tracemalloc.start()
    with pytest.raises(ManifestError, match=says):
        load_file(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 2**20
    for command in ("serve", "render"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err
        assert "Traceback" not in err


def test_the_bound_is_on_the_expanded_size_not_on_aliases() -> None:
    """Four levels (10**4 strings expanded) load; six (10**6) do not."""
    assert len(load(laughs(4))["a3"]) == 10
    with pytest.raises(ExpandsTooFar):
        load(laughs(6))


def test_ordinary_anchors_still_work(tmp_path: Path) -> None:
    stages = (
        "  stages:\n"
        "    - {name: thinker, sampling: &greedy {temperature: 0.0, maxTokens: 16}}\n"
        "    - {name: talker, sampling: *greedy}\n"
    )
    plain = stages.replace("&greedy ", "").replace("*greedy", "{temperature: 0.0, maxTokens: 16}")
    anchored, expanded = tmp_path / "anchored.yaml", tmp_path / "expanded.yaml"
    anchored.write_text(HEAD + "  model: tiny://qwen2.5-omni\n  pipeline: qwen2.5-omni\n" + stages)
    expanded.write_text(HEAD + "  model: tiny://qwen2.5-omni\n  pipeline: qwen2.5-omni\n" + plain)
    assert load_file(anchored) == load_file(expanded)
