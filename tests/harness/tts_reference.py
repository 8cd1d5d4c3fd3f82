"""qwen-tts's own outputs for the Qwen3-TTS equality tests: tests/harness/
qwen_tts_reference.py run by the side environment's interpreter on tiny checkpoints.

An output is kept under the tiny-model cache, keyed by what it depends on (every file of
the checkpoint, the case, the reference's pins, the script, the torch it borrows), so a
machine runs the reference once per case: a changed input is a new key."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from omnipipe.checkpoints.tiny import default_cache_dir, resolve_model_path
from omnipipe.families.qwen3_tts.reference_env import PINS, reference_python

SCRIPT = Path(__file__).with_name("qwen_tts_reference.py")


def _key(checkpoint: str, case: dict[str, Any]) -> str:
    import torch

    said = hashlib.sha1(json.dumps([case, PINS, torch.__version__], sort_keys=True).encode())
    said.update(SCRIPT.read_bytes())
    for path in sorted(p for p in Path(checkpoint).rglob("*") if p.is_file()):
        said.update(str(path.relative_to(checkpoint)).encode())
        said.update(path.read_bytes())
    return said.hexdigest()[:16]


def reference_outputs(
    asked: dict[str, tuple[str, dict[str, Any]]],
) -> dict[str, dict[str, np.ndarray]]:
    """{name: (tiny model, case)} -> each case's codes (frames x 16) and waveform
    (float32) from qwen-tts: the missing ones made in one side-environment run. A case
    with "decode" (codes, frames x 16) is the speech tokenizer's audio of those codes."""
    store = default_cache_dir() / "qwen-tts-reference-outputs"
    store.mkdir(parents=True, exist_ok=True)
    paths, missing = {}, []
    for name, (model, case) in asked.items():
        checkpoint = resolve_model_path(f"tiny://{model}")
        paths[name] = store / f"{_key(checkpoint, case)}.npz"
        if not paths[name].exists():
            missing.append({**case, "checkpoint": checkpoint, "out": str(paths[name])})
    if missing:
        listing = store / f"cases-{hashlib.sha1(str(missing).encode()).hexdigest()[:12]}.json"
        listing.write_text(json.dumps(missing))
        ran = subprocess.run(
            # -P: the script's folder (tests/harness) is not put on the path.
            [str(reference_python()), "-P", str(SCRIPT), str(listing)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        listing.unlink()
        assert ran.returncode == 0, ran.stderr[-3000:]
    return {name: dict(np.load(path)) for name, path in paths.items()}


def pcm_of(wav: np.ndarray) -> np.ndarray:
    """A float waveform as the 16-bit samples the server sends."""
    return np.round(np.clip(wav, -1, 1) * 32767)
