"""`omnipipe fetch MODEL DIR`: a model's files into DIR, whole or not at all.

Files land in a staging directory beside DIR (`.DIR.partial`, kept across attempts, so a
retried Hub download resumes), and DIR appears only by renaming a complete one, with a
marker file that says what it holds. So a reader never sees a half-written model, and a
failed fetch never leaves DIR looking ready. Failures carry a reason a controller can act
on (NoSpace, NoAccess, UnknownModel, UnknownRevision, Unreachable, NotEmpty, LocalPath)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from omnipipe.api.families import installed_families, load_attribute
from omnipipe.api.from_model import is_hub_id
from omnipipe.api.resolve import TINY_SCHEME

log = logging.getLogger(__name__)
COMPLETE = ".omnipipe-complete"


class FetchError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _out_of_space(exc: BaseException | None) -> bool:
    """A full disk, as an OSError or as a library's own error that wraps one in words
    (safetensors' writer says "No space left on device (os error 28)")."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if os.strerror(errno.ENOSPC) in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _size_of(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _download(model: str, revision: str | None, staging: Path) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        snapshot_download(model, revision=revision, local_dir=staging)
    except GatedRepoError as exc:
        raise FetchError("NoAccess", f"{model} is gated: give a token with access") from exc
    except RevisionNotFoundError as exc:
        raise FetchError("UnknownRevision", f"{model} has no revision {revision!r}") from exc
    except RepositoryNotFoundError as exc:
        # The Hub answers 401 for a private repository without a token as for a missing one.
        raise FetchError(
            "UnknownModel", f"{model}: no such model, or it is private (set HF_TOKEN)"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise FetchError("Unreachable", f"{model}: the Hugging Face Hub cannot be reached") from exc


def tiny_builders() -> dict[str, Callable[[Path], None]]:
    """tiny://NAME -> the function that writes it, from every installed family."""
    return {
        name: _lazy(reference)
        for family in installed_families().values()
        for name, reference in family.tiny_models.items()
    }


def _lazy(reference: str) -> Callable[[Path], None]:
    def build(target: Path) -> None:
        load_attribute(reference)(target)

    return build


def fetch(model: str, target: Path, revision: str | None = None) -> Path:
    """Makes `target` hold `model` (a Hub id or tiny://NAME); a no-op when it already does."""
    target = target.expanduser().absolute()
    marker = target / COMPLETE
    if marker.is_file():
        held = json.loads(marker.read_text())
        if (held.get("model"), held.get("revision")) != (model, revision):
            raise FetchError(
                "NotEmpty", f"{target} already holds {held.get('model')} @ {held.get('revision')}"
            )
        log.info("%s already holds %s", target, model)
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FetchError("NotEmpty", f"{target} exists and is not a completed fetch")
    if Path(model).expanduser().is_dir():
        raise FetchError("LocalPath", f"{model} is already a local directory: mount it instead")
    if not model.startswith(TINY_SCHEME) and not is_hub_id(model):
        raise FetchError(
            "UnknownModel",
            f"{model}: not a Hugging Face model id (owner/name) nor tiny://NAME; nothing "
            "was looked up",
        )
    staging = target.with_name(f".{target.name}.partial")
    started = time.monotonic()
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if model.startswith(TINY_SCHEME):
            name = model.removeprefix(TINY_SCHEME)
            builders = tiny_builders()
            if name not in builders:
                raise FetchError(
                    "UnknownModel",
                    f"unknown tiny model {model!r}; available: {', '.join(builders)}",
                )
            shutil.rmtree(staging)  # built whole each time: deterministic, and quick
            builders[name](staging)
        else:
            _download(model, revision, staging)
        (staging / COMPLETE).write_text(json.dumps({"model": model, "revision": revision}))
        if target.exists():
            target.rmdir()  # empty, checked above: e.g. a mount point's subdirectory
        staging.rename(target)
    except FetchError:
        raise
    except Exception as exc:
        if _out_of_space(exc):
            raise FetchError("NoSpace", f"no space left for {model} in {target.parent}") from exc
        raise
    files, size = _size_of(target)
    log.info(
        "%s: %d files, %.1f MiB in %s (%.0f s)",
        model,
        files,
        size / 2**20,
        target,
        time.monotonic() - started,
    )
    return target
