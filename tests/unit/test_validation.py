from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnipipe.api import ManifestError, load_file, parse_resource
from tests.invalid_manifests import CASES, Invalid

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_manifest_is_rejected_naming_the_field(case: Invalid) -> None:
    with pytest.raises(ManifestError) as err:
        parse_resource(case.make())
    assert case.local in str(err.value)


def test_at_least_twenty_invalid_cases() -> None:
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    resource = load_file(path)
    assert resource.metadata.name


def test_six_line_resource(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: img}\n"
        "spec:\n  model: Qwen/Qwen-Image\n  pipeline: qwen-image\n"
    )
    assert len(f.read_text().splitlines()) == 6
    assert load_file(f).spec.pipeline == "qwen-image"


def test_load_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="No such file"):
        load_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_file(bad)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"kind": "Deployment"}))
    with pytest.raises(ManifestError, match="expected exactly one OmniPipeline, found 0"):
        load_file(other)
