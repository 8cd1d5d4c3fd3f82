"""tests/harness/oci_layout.py: which blobs a layout's image needs, which of them an import
sends, and the layout's clean-up and check (hack/node-images.sh, tests/harness/node.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.harness import oci_layout

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def put(layout: Path, data: bytes, media_type: str) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = oci_layout.blob_path(layout, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def image(layout: Path, layers: list[bytes]) -> dict[str, object]:
    config = put(
        layout, b'{"rootfs": {"type": "layers"}}', "application/vnd.oci.image.config.v1+json"
    )
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": config,
        "layers": [put(layout, data, "application/vnd.oci.image.layer.v1.tar") for data in layers],
    }
    return put(layout, json.dumps(manifest).encode(), MANIFEST)


def write_index(layout: Path, manifests: list[dict[str, object]]) -> None:
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_an_image_needs_its_manifest_config_and_layers_and_no_older_build(tmp_path: Path) -> None:
    old = image(tmp_path, [b"torch and vllm", b"omnipipe v1"])
    new = image(tmp_path, [b"torch and vllm", b"omnipipe v2"])
    write_index(tmp_path, [new])

    needed = oci_layout.referenced(tmp_path)

    assert needed[0] == new["digest"]
    assert digest_of(b"torch and vllm") in needed
    assert digest_of(b"omnipipe v2") in needed
    assert old["digest"] not in needed
    assert digest_of(b"omnipipe v1") not in needed
    assert len(needed) == 4  # manifest, config, two layers


def test_a_nested_index_is_walked_to_its_images(tmp_path: Path) -> None:
    inner = image(tmp_path, [b"layer"])
    outer = put(tmp_path, json.dumps({"schemaVersion": 2, "manifests": [inner]}).encode(), INDEX)
    write_index(tmp_path, [outer])

    assert oci_layout.referenced(tmp_path)[:2] == [outer["digest"], inner["digest"]]
    assert digest_of(b"layer") in oci_layout.referenced(tmp_path)


def test_an_import_sends_only_the_blobs_the_importer_lacks(tmp_path: Path) -> None:
    write_index(tmp_path, [image(tmp_path, [b"torch and vllm", b"omnipipe v2"])])
    big = digest_of(b"torch and vllm")

    everything = oci_layout.tar_members(tmp_path, held=[])
    without_big = oci_layout.tar_members(tmp_path, held=[big, "sha256:" + "0" * 64])

    assert everything[:2] == ["oci-layout", "index.json"]
    assert len(everything) == 6
    assert "blobs/sha256/" + big.removeprefix("sha256:") in everything
    assert without_big == [m for m in everything if not m.endswith(big.removeprefix("sha256:"))]
    assert len(without_big) == 5
    assert all((tmp_path / m).is_file() for m in without_big)


def test_prune_deletes_what_no_image_needs_and_keeps_the_rest(tmp_path: Path) -> None:
    image(tmp_path, [b"torch and vllm", b"omnipipe v1"])
    write_index(tmp_path, [image(tmp_path, [b"torch and vllm", b"omnipipe v2"])])

    count, size = oci_layout.prune(tmp_path)

    # the old build's manifest and its omnipipe layer; the config is the same bytes
    assert count == 2
    assert size > len(b"omnipipe v1")
    kept = sorted(p.name for p in (tmp_path / "blobs/sha256").iterdir())
    assert kept == sorted(d.removeprefix("sha256:") for d in oci_layout.referenced(tmp_path))
    assert oci_layout.verify(tmp_path) == []
    assert oci_layout.prune(tmp_path) == (0, 0)


def test_verify_names_a_missing_a_short_and_a_changed_blob(tmp_path: Path) -> None:
    write_index(tmp_path, [image(tmp_path, [b"layer one", b"layer two", b"layer three"])])
    assert oci_layout.verify(tmp_path) == []
    one, two, three = (digest_of(d) for d in (b"layer one", b"layer two", b"layer three"))

    oci_layout.blob_path(tmp_path, one).unlink()
    oci_layout.blob_path(tmp_path, two).write_bytes(b"layer tw")
    oci_layout.blob_path(tmp_path, three).write_bytes(b"layer thref")

    problems = oci_layout.verify(tmp_path)
    assert len(problems) == 3
    assert problems[0] == f"{one}: missing"
    assert problems[1] == f"{two}: 8 bytes, descriptor says 9"
    assert problems[2].startswith(f"{three}: content hashes to sha256:")
    assert oci_layout.main(["verify", str(tmp_path)]) == 1
