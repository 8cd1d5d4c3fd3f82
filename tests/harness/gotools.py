"""What the harness shares about the Go programs hack/ builds for the tests (GitOps health,
Grafana dashboard checks, the OpenTelemetry Collector): where a build script's pinned
versions are, how it stamps a binary with its sources, and the check that a cached binary
was built from the sources checked out. The harness only runs them: a missing or stale
binary is an error that names the make target that builds it.

The stamp matches hack/lib/go-tools.sh's source_digest: sha256 over each file's path
relative to the tools' root, a NUL, then its bytes, in byte order of the paths.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path


def pinned_default(script: Path, variable: str) -> str:
    """The version a build script pins (its `VAR="${VAR:-vX}"` default), unless the
    environment overrides it, as it does for the script."""
    if variable in os.environ:
        return os.environ[variable]
    found = re.search(rf'^{variable}="\$\{{{variable}:-([^}}]+)\}}"$', script.read_text(), re.M)
    if found is None:
        raise RuntimeError(f"{script} pins no {variable}")
    return found.group(1)


def source_digest(root: Path, files: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for rel in sorted((p.relative_to(root).as_posix() for p in files), key=str.encode):
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    return digest.hexdigest()


def go_sources(package: Path) -> list[Path]:
    """A tool's own Go package: its *.go files."""
    return [p for p in package.glob("*.go") if p.is_file()]


def cached_binary(path: Path, stamp: str, sources: str, make_target: str, script: Path) -> Path:
    """`path`, when it exists and its `.src` stamp beside it is `stamp`; never builds it."""
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run `make {make_target}` ({script.name})")
    found = path.with_name(f"{path.name}.src")
    if not found.is_file() or found.read_text().strip() != stamp:
        raise RuntimeError(
            f"{path} was built from other sources than {sources}: "
            f"run `make {make_target}` ({script.name})"
        )
    return path
