"""An OmniPipeline for a model named alone (`omnipipe serve MODEL`, `omnipipe render
MODEL`): the checkpoint's own files say which pipeline type it is, as `vllm serve MODEL`
reads a model's config."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from omnipipe.api import constants as c
from omnipipe.api.families import any_diffusers_type, load_attribute, pipeline_types
from omnipipe.api.pipelines import pipeline_for_checkpoint
from omnipipe.api.resolve import TINY_SCHEME
from omnipipe.api.resource import MAX_PIPELINE_NAME, ManifestError, OmniPipeline, parse_resource

# diffusers describes a pipeline in model_index.json, transformers a model in config.json.
DIFFUSERS_DESCRIPTOR = "model_index.json"
_DESCRIPTORS = ((DIFFUSERS_DESCRIPTOR, "_class_name"), ("config.json", "model_type"))
# What names a file, never a model: `omnipipe serve nope.yaml` is a missing file.
FILE_SUFFIXES = (".yaml", ".yml", ".json")
# The Hub's own rule for a repository id (huggingface_hub.utils.validate_repo_id), with
# the owner required: word characters, '-' and '.', at most 96 characters. The Hub still
# answers a few legacy ids without an owner (gpt2), but a bare word on a command line is
# far likelier a mistyped file, and looking it up costs seconds of retries.
_HUB_ID = re.compile(r"\b[\w.-]+\b/\b[\w.-]+\b")
MAX_HUB_ID = 96
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(name: str) -> bool:
    """Whether `name` is shaped like a Hugging Face repository id, owner/name; only such
    names are looked up on the Hub."""
    return (
        len(name) <= MAX_HUB_ID
        and _HUB_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith((".git", *FILE_SUFFIXES))
    )


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, read now: the library reads it once,
    at import."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def check_model_target(target: str) -> Path | None:
    """The local checkpoint directory `target` names, or None for a Hub id. Anything
    else is an error at once, with no network: a missing file or directory is never
    taken for a Hub id."""
    local = Path(target).expanduser()
    if local.is_dir():
        return local
    neither = f"{target}: neither a pipeline file nor a model directory"
    if local.exists():
        raise ManifestError(neither)
    if target.lower().endswith(FILE_SUFFIXES):
        raise ManifestError(f"{neither}: no such file")
    if not is_hub_id(target):
        raise ManifestError(
            f"{neither}: no such file or directory (and not a Hugging Face model id, owner/name)"
        )
    return None


def _read_local(directory: Path, filename: str) -> dict[str, Any] | None:
    path = directory / filename
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not readable JSON: {exc}") from None
    return doc if isinstance(doc, dict) else None


def _read_hub(repo_id: str, filename: str) -> dict[str, Any] | None:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RemoteEntryNotFoundError
    except ImportError:
        raise ManifestError(
            f"{repo_id}: reading a Hub model needs huggingface_hub (pip install "
            "'omnipipe[models]'), or pass a local checkpoint directory"
        ) from None
    offline = hub_offline()
    if offline and (cached := _offline_cached(repo_id, filename)) is not None:
        return _read_local(cached.parent, cached.name) if cached.name else None
    try:
        path = hf_hub_download(repo_id, filename, local_files_only=offline)
    except RemoteEntryNotFoundError:  # the repository has no such file: try the next
        return None
    except Exception as exc:  # offline, unknown repo, gated, bad id: all say why
        if offline:
            raise ManifestError(
                f"{repo_id}: not a local directory, and HF_HUB_OFFLINE is set: its "
                f"{filename} could not be read from the Hugging Face Hub's local cache"
            ) from None
        raise ManifestError(
            f"{repo_id}: not a local directory, and its {filename} could not be read from "
            f"the Hugging Face Hub ({type(exc).__name__}: {exc})"
        ) from None
    return _read_local(Path(path).parent, Path(path).name)


def _offline_cached(repo_id: str, filename: str) -> Path | None:
    """With no network, what the local Hub cache says of the repository's `filename`:
    its path; Path() where the repository is cached but the file is not (a diffusers
    snapshot has no config.json: absent, not unreadable); None where the repository
    itself is not cached."""
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    if isinstance(found, str):
        return Path(found)
    repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    return Path() if snapshots.is_dir() and any(snapshots.iterdir()) else None


def checkpoint_descriptors(checkpoint: str) -> dict[str, str]:
    """What the checkpoint (a local directory or a Hub id) says it is, by the file that
    says so: {"model_index.json": its pipeline class, "config.json": its model type}."""
    local = check_model_target(checkpoint)
    said = {}
    for filename, key in _DESCRIPTORS:
        doc = _read_local(local, filename) if local else _read_hub(checkpoint, filename)
        if doc and isinstance(doc.get(key), str):
            said[filename] = doc[key]
    return said


def checkpoint_kinds(checkpoint: str) -> list[str]:
    """What the checkpoint (a local directory or a Hub id) says it is."""
    return list(checkpoint_descriptors(checkpoint).values())


def is_diffusers_checkpoint(said: dict[str, str]) -> bool:
    """A diffusers pipeline checkpoint: one that has a model_index.json."""
    return DIFFUSERS_DESCRIPTOR in said


def pipeline_name_for(model: str) -> str:
    """A DNS label from the model's last path part: Qwen/Qwen2.5-Omni-7B -> qwen2-5-omni-7b."""
    tail = model.removeprefix(TINY_SCHEME).rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"model-{name}".rstrip("-")
    return name[:MAX_PIPELINE_NAME].rstrip("-")


def known_checkpoints() -> str:
    return "; ".join(
        f"{p.name} ({', '.join(p.checkpoints)}; e.g. {', '.join(p.example_models)})"
        for p in pipeline_types().values()
        if p.checkpoints
    )


def manifest_for_model(model: str, said: dict[str, str]) -> OmniPipeline:
    """The OmniPipeline that serves `model`, whose checkpoint says it is `said`
    (checkpoint_descriptors): the type that claims it, else, for a diffusers checkpoint,
    the catch-all that runs any diffusers pipeline whole (of its family's types, the one
    its type_for_class picks for the checkpoint's class)."""
    kinds = list(said.values())
    pipeline = pipeline_for_checkpoint(kinds)
    if pipeline is None and is_diffusers_checkpoint(said) and (found := any_diffusers_type()):
        catch_all = found[1]
        pipeline = catch_all.name
        if catch_all.type_for_class is not None:
            pipeline = str(load_attribute(catch_all.type_for_class)(said[DIFFUSERS_DESCRIPTOR]))
    if pipeline is None:
        said_text = ", ".join(kinds) if kinds else "no model_index.json or config.json type"
        raise ManifestError(
            f"{model}: omnipipe has no pipeline for this architecture ({said_text}). "
            f"Known: {known_checkpoints()}"
        )
    return parse_resource(
        {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "metadata": {"name": pipeline_name_for(model)},
            "spec": {"model": model, "pipeline": pipeline},
        }
    )
