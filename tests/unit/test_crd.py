from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnipipe.api.crd import build_crd, render_crd_yaml
from omnipipe.api.families import installed_families
from tests.harness.families import only_families, own_family_names

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "crds" / "omnipipelines.omnipipe.io.yaml"


@pytest.fixture
def own_families(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Committed files are generated as omnipipe's image, with no plugin, generates them."""
    with only_families(monkeypatch, own_family_names()):
        yield


@pytest.mark.usefixtures("own_families")
def test_committed_crd_matches_the_models() -> None:
    assert COMMITTED.read_text() == render_crd_yaml(), (
        "crds/ drifted from omnipipe/api: run `make manifests` and commit the result"
    )


def _fields_without_description(node: dict[str, Any], path: str) -> list[str]:
    missing = [] if node.get("description") or path.endswith("[]") else [path]
    for name, child in node.get("properties", {}).items():
        missing += _fields_without_description(child, f"{path}.{name}")
    if "items" in node:
        missing += _fields_without_description(node["items"], f"{path}[]")
    return missing


def _keys_named(key: str, node: Any) -> list[Any]:
    if isinstance(node, dict):
        found = [node[key]] if key in node else []
        return found + [x for v in node.values() for x in _keys_named(key, v)]
    if isinstance(node, list):
        return [x for v in node for x in _keys_named(key, v)]
    return []


def test_every_spec_and_status_field_has_a_description() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in ("spec", "status"):
        assert _fields_without_description(schema["properties"][part], part) == []


def test_crd_shape() -> None:
    crd = yaml.safe_load(COMMITTED.read_text())
    assert crd["spec"]["names"]["shortNames"] == ["omnip"]
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == [
        "Model",
        "Stages",
        "Ready",
        "Reason",
        "Endpoint",
        "Age",
    ]
    assert [c["name"] for c in columns if c.get("priority")] == ["Progressing", "Current", "Update"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    stages = spec["properties"]["stages"]
    assert stages["x-kubernetes-list-type"] == "map"
    assert stages["x-kubernetes-list-map-keys"] == ["name"]
    # The API server would persist schema defaults into every stage override.
    assert not _keys_named("default", version["schema"])
    messages = " ".join(r["message"] for r in spec["x-kubernetes-validations"])
    for rule in ("unique", "every input", "cycles", "role and engine"):
        assert rule in messages


@pytest.mark.usefixtures("own_families")
def test_readme_field_reference_matches_the_models() -> None:
    from omnipipe.api.reference import field_reference_markdown

    assert field_reference_markdown() in (REPO / "README.md").read_text(), (
        "README's field reference drifted: run `make manifests`"
    )


def test_bounds_are_openapi_v3_not_json_schema() -> None:
    """The API server rejects JSON Schema's numeric exclusive bounds (it wants booleans)."""

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for key in ("exclusiveMinimum", "exclusiveMaximum"):
                if key in node:
                    assert node[key] is True, f"{path}.{key} = {node[key]!r}"
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(build_crd(), "crd")


def test_the_venvs_own_crd_is_the_committed_one_while_tests_have_their_plugin() -> None:
    """The tests' outside family is on the path only while tests run
    (tests/harness/plugin_path.py): `omnipipe crd` in the venv, as a user or `make serve`
    runs it, with no OMNIPIPE_FAMILIES, prints the committed CRD."""
    from omnipipe.api.families import FAMILIES_ENV
    from tests.harness.plugin_path import TARGET

    assert "sketch" in installed_families()  # this process has the plugin
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", FAMILIES_ENV}}
    crd = subprocess.run(
        [sys.executable, "-m", "omnipipe.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=TARGET.parent,
    ).stdout
    assert crd == COMMITTED.read_text(), "the venv itself has a family omnipipe does not ship"
