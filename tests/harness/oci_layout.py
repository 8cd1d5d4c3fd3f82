"""OCI image layouts as hack/node-images.sh writes them for the real node: which blobs an
image needs, which of them containerd lacks, and the layout's clean-up and check.

Standard library only: hack/node-images.sh runs it with the system's python3 before any
venv exists (`python3 -m tests.harness.oci_layout prune|verify LAYOUT`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path

INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}


def blob_path(layout: Path, digest: str) -> Path:
    algorithm, _, hex_digest = digest.partition(":")
    return layout / "blobs" / algorithm / hex_digest


def descriptors(layout: Path) -> list[dict[str, object]]:
    """Every descriptor the layout's index.json reaches, each once, in walk order:
    manifests (and nested indexes), then each manifest's config and layers."""
    found: dict[str, dict[str, object]] = {}
    todo = list(json.loads((layout / "index.json").read_text())["manifests"])
    while todo:
        desc = todo.pop(0)
        digest = str(desc["digest"])
        if digest in found:
            continue
        found[digest] = desc
        if desc.get("mediaType") in INDEX_TYPES:
            todo.extend(json.loads(blob_path(layout, digest).read_bytes())["manifests"])
        elif desc.get("mediaType") in MANIFEST_TYPES:
            body = json.loads(blob_path(layout, digest).read_bytes())
            todo.extend([body["config"], *body["layers"]])
    return list(found.values())


def referenced(layout: Path) -> list[str]:
    """The digests of every blob the layout's images need."""
    return [str(d["digest"]) for d in descriptors(layout)]


def tar_members(layout: Path, held: Iterable[str]) -> list[str]:
    """What an import needs from `layout` when the importer already holds the blobs
    `held` (digests): the layout's two files and every blob it needs that is not held."""
    have = set(held)
    missing = [d for d in referenced(layout) if d not in have]
    return ["oci-layout", "index.json"] + [str(blob_path(Path(), d)) for d in missing]


def prune(layout: Path) -> tuple[int, int]:
    """Delete the blobs that no image of the layout needs (an older build's); the
    number of blobs and bytes deleted."""
    keep = {blob_path(layout, d) for d in referenced(layout)}
    count = size = 0
    for path in (layout / "blobs").glob("*/*"):
        if path not in keep and path.is_file():
            size += path.stat().st_size
            path.unlink()
            count += 1
    return count, size


def verify(layout: Path) -> list[str]:
    """Each blob the layout's images need whose size or digest is not its descriptor's,
    as a line saying so; empty when the layout is whole."""
    problems = []
    for desc in descriptors(layout):
        digest, path = str(desc["digest"]), blob_path(layout, str(desc["digest"]))
        if not path.is_file():
            problems.append(f"{digest}: missing")
            continue
        if path.stat().st_size != desc["size"]:
            problems.append(
                f"{digest}: {path.stat().st_size} bytes, descriptor says {desc['size']}"
            )
            continue
        algorithm = digest.partition(":")[0]
        hashed = hashlib.new(algorithm)
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                hashed.update(chunk)
        if f"{algorithm}:{hashed.hexdigest()}" != digest:
            problems.append(f"{digest}: content hashes to {algorithm}:{hashed.hexdigest()}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("prune", "verify"):
        print("usage: python3 -m tests.harness.oci_layout prune|verify LAYOUT", file=sys.stderr)
        return 2
    layout = Path(argv[1])
    if argv[0] == "prune":
        count, size = prune(layout)
        print(f"{layout}: {count} unused blobs deleted ({size / 1e6:.0f} MB)")
        return 0
    problems = verify(layout)
    for line in problems:
        print(f"{layout}: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
