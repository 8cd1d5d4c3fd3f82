"""AsyncOmni's control calls, with vLLM-Omni's names: pause and resume generation, sleep
and wake up, the profiler, the tokenizer and the engine caches (the router's /admin API,
which sends each to every replica of a stage), and LoRA adapters. An AsyncOmni that
started the pipeline itself changes adapters as a user of `omnipipe serve` does: in its
pipeline file's spec.adapters, then a reload (SIGHUP). Attached to a router, it asks the
router, which says where they are changed (the resource, on Kubernetes)."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from omnipipe.api.yamlio import load as load_yaml
from omnipipe.client.types import OmniError, error_of

# The supervisor's closing line for one reload (omnipipe/local/rollout.py).
RELOADED = ("omnipipe: reloaded:", "omnipipe: no change;")
NOT_RELOADED = ("omnipipe: reload failed,", "omnipipe: reload refused,")
RELOAD_TIMEOUT_SECONDS = 600.0
# Changes a manifest's spec in place, given the stages that take adapters.
AdapterChange = Callable[[dict[str, Any], list[str]], None]


def own_pipeline_file(
    model: str | None, stage_configs_path: str | os.PathLike[str] | None
) -> tuple[Path, Path | None]:
    """The file this client's `omnipipe serve` runs and add_lora edits: a copy of the
    given file, or MODEL's pipeline as `omnipipe render` writes it, in a folder of its own
    (the second item, for the client to remove; None when there is no file to copy)."""
    if stage_configs_path is None and model is not None and Path(model).expanduser().is_file():
        stage_configs_path = Path(model).expanduser()  # serve takes a file as its MODEL too
    if stage_configs_path is not None:
        source = Path(stage_configs_path)
        if not source.is_file():
            return source, None  # serve says what is wrong with it
        folder = Path(tempfile.mkdtemp(prefix="omnipipe-client-"))
        target = folder / source.name
        target.write_bytes(source.read_bytes())
        return target, folder
    assert model is not None
    rendered = subprocess.run(
        [sys.executable, "-m", "omnipipe.cli", "render", model],
        capture_output=True,
        text=True,
        check=False,
    )
    if rendered.returncode != 0:
        raise OmniError(f"omnipipe render {model} failed:\n{rendered.stderr[-2000:]}")
    folder = Path(tempfile.mkdtemp(prefix="omnipipe-client-"))
    target = folder / "pipeline.yaml"
    target.write_text(rendered.stdout)
    return target, folder


def _lora_fields(lora: Any, source: str | None) -> tuple[str, str | None]:
    """(name, source) from a name and a source, or from vLLM's LoRARequest."""
    if isinstance(lora, str):
        return lora, source
    name, path = getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
    if not isinstance(name, str):
        raise TypeError("lora: a name, or an object with lora_name and lora_path (LoRARequest)")
    return name, source or path


class ControlCalls:
    """Mixed into AsyncOmni, which sets these."""

    base_url: str
    _http: httpx.AsyncClient
    _proc: subprocess.Popen[bytes] | None
    _log_path: Path | None
    _pipeline_file: Path | None
    _adapter_lock: asyncio.Lock | None

    async def _admin(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        resp = await self._http.request(method, f"/admin/{path}", json=body, params=query)
        if resp.status_code != 200:
            raise error_of(resp.status_code, resp.content)
        answer: dict[str, Any] = resp.json()
        return answer

    async def _act(
        self, action: str, stages: Sequence[str] | None, **fields: Any
    ) -> dict[str, Any]:
        body = {**fields, **({"stages": list(stages)} if stages is not None else {})}
        return await self._admin("POST", action, body)

    async def _states(self) -> list[dict[str, Any]]:
        stages = (await self._admin("GET", "stages"))["stages"]
        return [replica for replicas in stages.values() for replica in replicas]

    # -- generation ------------------------------------------------------------------------

    async def pause_generation(
        self, mode: Literal["abort", "wait"] = "abort", stages: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """No request starts until resume_generation(); those in flight are aborted
        (their clients get a 503) or, with mode="wait", finish first."""
        return await self._act("pause", stages, mode=mode)

    async def resume_generation(self, stages: Sequence[str] | None = None) -> dict[str, Any]:
        return await self._act("resume", stages)

    async def is_paused(self) -> bool:
        """Whether any replica of any stage is paused."""
        return any(replica.get("paused") for replica in await self._states())

    # -- sleep -----------------------------------------------------------------------------

    async def sleep(self, level: int = 1, stages: Sequence[str] | None = None) -> dict[str, Any]:
        """Level 1 moves each stage's models to host memory, level 2 drops them; a request
        (or wake_up) brings them back. The answer says what each replica released."""
        return await self._act("sleep", stages, level=level)

    async def wake_up(self, stages: Sequence[str] | None = None) -> dict[str, Any]:
        return await self._act("wake_up", stages)

    async def is_sleeping(self) -> bool:
        """Whether any replica of any stage is asleep."""
        return any(replica.get("sleeping") for replica in await self._states())

    # -- the profiler, caches, tokenizer ---------------------------------------------------

    async def start_profile(self, stages: Sequence[str] | None = None) -> dict[str, Any]:
        """Starts the torch profiler on each replica's engine thread."""
        return await self._act("start_profile", stages)

    async def stop_profile(self, stages: Sequence[str] | None = None) -> dict[str, Any]:
        """Stops it; each replica's answer names its trace file (`trace`, a Chrome trace)."""
        return await self._act("stop_profile", stages)

    async def reset_prefix_cache(self, stages: Sequence[str] | None = None) -> dict[str, Any]:
        """Clears the vLLM stages' prefix caches (after their running requests finish)."""
        return await self._act("reset_prefix_cache", stages)

    async def reset_mm_cache(self, stages: Sequence[str] | None = None) -> dict[str, Any]:
        """Clears the vLLM stages' processed-media caches."""
        return await self._act("reset_mm_cache", stages)

    async def get_tokenizer(self, stage: str | None = None) -> Any:
        """The tokenizer of the pipeline's first stage that reads text (or of `stage`), as
        transformers loads it from the files the stage saved."""
        from transformers import AutoTokenizer

        answer = await self._admin("GET", "tokenizer", query={"stage": stage} if stage else None)

        def load(files: dict[str, str]) -> Any:
            with tempfile.TemporaryDirectory(prefix="omnipipe-tokenizer-") as folder:
                for name, content in files.items():
                    (Path(folder) / Path(name).name).write_bytes(base64.b64decode(content))
                return AutoTokenizer.from_pretrained(folder)

        return await asyncio.to_thread(load, answer["files"])

    # -- LoRA adapters ---------------------------------------------------------------------

    async def list_loras(self) -> list[str]:
        """The pipeline's LoRA adapters (spec.adapters): name one as generate()'s model,
        or in lora={"name": ..., "scale": ...}."""
        return sorted(a["name"] for a in (await self._admin("GET", "loras"))["adapters"])

    async def pin_lora(self, name: str) -> bool:
        """omnipipe never evicts an adapter (each stays loaded until it is removed), so
        every listed one is pinned: True for it, False for a name it does not list."""
        return name in await self.list_loras()

    async def add_lora(
        self, lora: Any, source: str | None = None, *, stage: str | None = None, scale: float = 1.0
    ) -> bool:
        """Adds an adapter (a name and its source, or vLLM's LoRARequest) to the pipeline
        file and reloads it; the running workers load it without a restart. Raises
        ValueError for an adapter the file cannot take, OmniError when the reload fails
        (the file is put back)."""
        name, where = _lora_fields(lora, source)
        if where is None:
            raise ValueError("add_lora needs the adapter's source (a directory or a Hub id)")
        file = await self._adapters_file()

        def change(spec: dict[str, Any], takers: list[str]) -> None:
            adapters = [a for a in spec.get("adapters") or [] if a.get("name") != name]
            if stage is None and len(takers) != 1:
                raise ValueError(f"add_lora: name the stage, one of {', '.join(takers)}")
            target = stage or takers[0]
            adapters.append({"name": name, "source": where, "stage": target, "scale": scale})
            spec["adapters"] = adapters

        await self._change_adapters(file, change)
        return True

    async def remove_lora(self, name: str) -> bool:
        """Removes an adapter from the pipeline file and reloads it; False if it has none
        of that name."""
        file = await self._adapters_file()
        spec = _spec_of(load_yaml(await asyncio.to_thread(file.read_text)), file)
        if not any(a.get("name") == name for a in spec.get("adapters") or []):
            return False

        def change(spec: dict[str, Any], _takers: list[str]) -> None:
            spec["adapters"] = [a for a in spec.get("adapters") or [] if a.get("name") != name]
            if not spec["adapters"]:
                del spec["adapters"]

        await self._change_adapters(file, change)
        return True

    async def _adapters_file(self) -> Path:
        if self._pipeline_file is None:
            # Attached: the router says where this pipeline's adapters are changed.
            await self._admin("POST", "loras")
            raise OmniError("the router took an adapter change it should refuse")
        return self._pipeline_file

    async def _change_adapters(self, file: Path, change: AdapterChange) -> None:
        if self._adapter_lock is None:
            self._adapter_lock = asyncio.Lock()
        async with self._adapter_lock:
            before = await asyncio.to_thread(_write_change, file, change)
            try:
                await self._reload()
            except OmniError:
                await asyncio.to_thread(file.write_text, before)
                raise

    async def _reload(self) -> None:
        """SIGHUP to this client's `omnipipe serve`; returns once its log says the reload
        was applied, raises OmniError with its reason when it was not."""
        assert self._proc is not None
        assert self._log_path is not None
        offset = self._log_path.stat().st_size
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + RELOAD_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise OmniError(f"omnipipe serve exited with status {self._proc.returncode}")
            with self._log_path.open("rb") as log:
                log.seek(offset)
                lines = log.read().decode(errors="replace").splitlines()
            for line in lines:
                if line.startswith(RELOADED):
                    return
                if line.startswith(NOT_RELOADED):
                    raise OmniError(line.removeprefix("omnipipe: "), 400)
            await asyncio.sleep(0.2)
        raise OmniError(f"omnipipe serve did not reload within {RELOAD_TIMEOUT_SECONDS:.0f}s")


def _write_change(file: Path, change: AdapterChange) -> str:
    """Changes the file's spec.adapters, if the result is a pipeline (else ValueError,
    the file untouched); what the file held before."""
    from omnipipe.api import ManifestError
    from omnipipe.api.adapters import ADAPTER_ROLES
    from omnipipe.api.loading import load_pipeline

    before = file.read_text()
    doc = load_yaml(before)
    running = load_pipeline(file)
    change(_spec_of(doc, file), [s.name for s in running.stages if s.role in ADAPTER_ROLES])
    candidate = file.with_name(f".{file.name}.new")
    candidate.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        load_pipeline(candidate)
    except ManifestError as exc:
        candidate.unlink()
        raise ValueError(str(exc)) from None
    candidate.replace(file)
    return before


def _spec_of(doc: Any, file: Path) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("kind") != "OmniPipeline":
        raise ValueError(
            f"{file} is not an OmniPipeline manifest: change its stages' adapters by hand"
        )
    spec: dict[str, Any] = doc.setdefault("spec", {})
    return spec
