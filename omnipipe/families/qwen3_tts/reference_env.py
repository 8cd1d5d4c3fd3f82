"""The model authors' own `qwen-tts` in a side environment: what builds the tiny Qwen3-TTS
checkpoints (through its classes, so they have the released layout) and what the
equality tests compare against.

qwen-tts 0.1.1 pins transformers 4.57.3 and does not import on the 5.x this project runs,
so it gets a virtualenv of its own beside the project's, made once per machine: the same
interpreter, its own transformers, tokenizers and hub client, and torch and numpy
borrowed from the project's environment through a path file read after its own
packages (docs/design/qwen3-tts.md). Building it needs PyPI, about 265 MB and 45 s."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

# The reference and what it needs that the project's environment lacks or holds at other
# versions. scikit-learn is left out on purpose: transformers 4.57 imports it whenever it
# is importable, and the installed one then breaks `import qwen_tts`.
PINS = (
    "qwen-tts==0.1.1",
    "transformers==4.57.3",
    "accelerate==1.12.0",
    "tokenizers==0.22.2",
    "huggingface_hub==0.36.2",
    "librosa==0.11.0",
    "audioread==3.1.0",
    "lazy_loader==0.6",
    "pooch==1.9.0",
    "soxr==1.1.0",
    "scipy==1.17.1",
    "joblib==1.6.0",
    "soundfile==0.14.0",
    "sox==1.5.0",
    "onnxruntime==1.32.0",
    "flatbuffers==25.12.19",
    "coloredlogs==15.0.1",
    "humanfriendly==10.0",
)
READY = ".omnipipe-ready"
BUILD_TIMEOUT = 900  # seconds for pip to fetch and install PINS


def _project_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _key() -> str:
    said = json.dumps([PINS, sys._base_executable, _project_packages()])  # type: ignore[attr-defined]
    return hashlib.sha1(said.encode()).hexdigest()[:12]


def default_root() -> Path:
    base = os.environ.get("OMNIPIPE_CACHE_DIR") or Path.home() / ".cache" / "omnipipe"
    return Path(base) / "qwen-tts-reference" / _key()


def reference_python(root: Path | None = None) -> Path:
    """The side environment's interpreter, built first if this machine has none."""
    root = root or default_root()
    python = root / "bin" / "python"
    if (root / READY).exists():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f".{root.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / READY).exists():
            _build(root)
    return python


def _build(root: Path) -> None:
    log.info("building qwen-tts's reference environment in %s (PyPI, about 45 s)", root)
    shutil.rmtree(root, ignore_errors=True)
    base = sys._base_executable  # type: ignore[attr-defined]
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    # Installed before the path file exists, so pip never sees (and never replaces) the
    # project's own transformers, tokenizers and hub client.
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"),
            *("--disable-pip-version-check", "--no-deps", "--no-compile", *PINS),
        ],
        check=True,
        timeout=BUILD_TIMEOUT,
    )
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A plain path line: appended after the side environment's own packages, and the
    # project's own .pth files (its editable omnipipe) are not read.
    Path(own, "zz-omnipipe-project.pth").write_text(_project_packages() + "\n")
    (root / READY).write_text(" ".join(PINS) + "\n")
