"""tiny://qwen3-tts-custom-voice, -voice-design and -base: Qwen3-TTS's released
layout with tiny random weights (about 430k parameters), made through qwen-tts's own
classes in its side environment (reference_env.py, side/make_tiny.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from omnipipe.families.qwen3_tts.reference_env import reference_python

MAKER = Path(__file__).parent / "side" / "make_tiny.py"
MAKE_TIMEOUT = 600  # seconds; about 20 on two busy cores


def _build(kind: str, target: Path) -> None:
    python = reference_python()
    made = subprocess.run(
        [str(python), str(MAKER), kind, str(target)],
        capture_output=True,
        text=True,
        check=False,
        timeout=MAKE_TIMEOUT,
    )
    if made.returncode != 0:
        said = made.stderr[-3000:]
        raise RuntimeError(f"making a tiny Qwen3-TTS {kind} checkpoint failed:\n{said}")


def build_custom_voice(target: Path) -> None:
    _build("custom_voice", target)


def build_voice_design(target: Path) -> None:
    _build("voice_design", target)


def build_base(target: Path) -> None:
    _build("base", target)
