"""tiny://NAME models: the real architectures with tiny random weights, written once to a
cache directory and then loaded by the same from_pretrained path as real checkpoints.

Weights are deterministic (fixed seeds), so every worker process that builds the model
gets the same bytes; a file lock keeps concurrent workers from building it twice.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from omnipipe.api.from_model import is_hub_id
from omnipipe.api.resolve import TINY_SCHEME
from omnipipe.checkpoints.fetch import COMPLETE, fetch, tiny_builders

log = logging.getLogger(__name__)
# Bump when a builder changes, so stale caches are rebuilt.
# 9: built by `omnipipe fetch`, marked with its .omnipipe-complete.
# 10: the Qwen Omni talkers' head_dim is 32, as vLLM's CPU attention needs.
# 11: the Qwen3-TTS talkers' head_dim is 32 too (their talker on vLLM).
TINY_FORMAT = "11-fetch"


def default_cache_dir() -> Path:
    base = os.environ.get("OMNIPIPE_CACHE_DIR") or Path.home() / ".cache" / "omnipipe"
    return Path(base) / "tiny"


def resolve_model_path(model: str, cache_dir: Path | None = None) -> str:
    """A path or hub id that from_pretrained accepts; builds tiny:// models on first use,
    through `omnipipe fetch` (the same path the operator's fetch Job takes), under a file
    lock so that concurrent workers build once."""
    if not model.startswith(TINY_SCHEME):
        if Path(model).expanduser().is_dir() or is_hub_id(model):
            return model
        # Never taken for a Hub id (diffusers would try the network, then say so).
        raise FileNotFoundError(f"model {model}: no such directory, and not a Hugging Face id")
    name = model.removeprefix(TINY_SCHEME)
    if name not in (builders := tiny_builders()):
        raise ValueError(f"unknown tiny model {model!r}; available: {', '.join(builders)}")

    root = (cache_dir or default_cache_dir()) / f"{name}-v{TINY_FORMAT}"
    if (root / COMPLETE).exists():
        return str(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / COMPLETE).exists():
            log.info("building %s with random weights in %s", model, root)
            fetch(model, root)
    return str(root)


__all__ = ["TINY_SCHEME", "default_cache_dir", "resolve_model_path"]
