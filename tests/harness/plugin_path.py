"""The tests' outside family (tests/plugins/sketch) lives in build/test-plugins, never in
the project's venv: it is on sys.path, and on PYTHONPATH for the processes the tests
start, only while tests run. So `omnipipe crd`, `make serve` and every user command in
the venv see omnipipe's own families alone, and the plugin is still found as a third
party's is, through its distribution's entry point."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "plugins"
TARGET = REPO / "build" / "test-plugins"
KEY_FILE = ".installed-key"
# What a build leaves in the source tree, which says nothing of what is installed.
_NOT_SOURCE = {"build", "__pycache__"}


def _key() -> str:
    digest = hashlib.sha1()
    for path in sorted(PLUGINS.rglob("*")):
        relative = path.relative_to(PLUGINS)
        built = _NOT_SOURCE & set(relative.parts) or any(
            part.endswith(".egg-info") for part in relative.parts
        )
        if path.is_file() and not built:
            digest.update(str(relative).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def install() -> Path:
    """build/test-plugins holding every plugin under tests/plugins, installed by pip
    (--target) when their sources changed; under a lock, as several pytest processes
    (xdist's workers) may start at once."""
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    key = _key()
    with (TARGET.parent / ".test-plugins.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = TARGET / KEY_FILE
        if marker.is_file() and marker.read_text() == key:
            return TARGET
        staging = TARGET.with_name("test-plugins.partial")
        shutil.rmtree(staging, ignore_errors=True)
        plugins = sorted(str(p) for p in PLUGINS.iterdir() if (p / "pyproject.toml").is_file())
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        subprocess.run(
            [*pip, "--no-build-isolation", "--target", str(staging), *plugins], check=True
        )
        (staging / KEY_FILE).write_text(key)
        shutil.rmtree(TARGET, ignore_errors=True)
        staging.rename(TARGET)
    return TARGET


def activate() -> None:
    """The plugins importable here and in every process started from here."""
    path = str(install())
    if path not in sys.path:
        sys.path.insert(0, path)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in inherited:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *inherited])
