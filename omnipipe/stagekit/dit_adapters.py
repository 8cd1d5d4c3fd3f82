"""LoRA adapters in a diffusers DiT (diffusers' PEFT integration), and the one a batch
applies: requests that name different adapters, or scales, never share a forward. A
family's denoiser names its pipeline class, whose own `lora_state_dict` reads every LoRA
file layout diffusers knows for that model and converts other trainers' key names."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omnipipe.api.adapters import MAX_LORA_RANK, MAX_SCALE, Adapter
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import StageInputError

log = logging.getLogger(__name__)

# What a request applies: an adapter's name and its scale; None is the base model.
LoraChoice = tuple[str, float] | None
# An adapter's files -> its weights by layer name, its network alphas (None: the file
# has none apart) and its saved LoRA config (None: none saved): `_lora_reader`.
LoraFiles = tuple[Mapping[str, Any], Mapping[str, Any] | None, Mapping[str, Any] | None]
StateDictReader = Callable[[str], LoraFiles]


def _lora_reader(pipeline_class: Any) -> StateDictReader:
    """A pipeline class's own LoRA reading, as its `load_lora_weights` reads: with the
    alphas and the saved config (lora_alpha), which set the adapter's strength. Without
    them PEFT takes alpha for the rank, and an adapter trained with another alpha would
    apply at another strength than diffusers gives it. Pipelines differ in what their
    `lora_state_dict` can return (FLUX's keeps alphas apart; Qwen-Image's folds them in)."""
    takes_alphas = "return_alphas" in inspect.signature(pipeline_class.lora_state_dict).parameters

    def read(path: str) -> LoraFiles:
        if takes_alphas:
            layers, alphas, metadata = pipeline_class.lora_state_dict(
                path, return_alphas=True, return_lora_metadata=True
            )
            return layers, alphas or None, metadata
        layers, metadata = pipeline_class.lora_state_dict(path, return_lora_metadata=True)
        return layers, None, metadata

    return read


def lora_key(params: Mapping[str, Any]) -> Any:
    """The request's `lora` parameter as a batch key, unchecked (lora_choice checks it)."""
    lora = params.get("lora")
    return None if not isinstance(lora, Mapping) else (repr(lora.get("name")), lora.get("scale"))


def lora_choice(params: Mapping[str, Any], loaded: set[str]) -> LoraChoice:
    """The request's `lora` parameter ({"name", "scale"}, set by the router), checked
    against the adapters this stage loaded."""
    lora = params.get("lora")
    if lora is None:
        return None
    if not isinstance(lora, Mapping):
        raise StageInputError("lora: must be an object with a name and a scale")
    name, scale = lora.get("name"), lora.get("scale")
    if name not in loaded:
        raise StageInputError(f"lora.name: this stage has no adapter {name!r}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 <= scale <= MAX_SCALE:
        raise StageInputError(
            f"lora.scale: must be a number from 0 to {MAX_SCALE:g}, got {scale!r}"
        )
    return str(name), float(scale)


class LoadedAdapters:
    """The stage's adapters, loaded into each copy of its DiT, all off until a batch
    asks for one."""

    def __init__(
        self, transformers: Sequence[Any], adapters: Sequence[Adapter], pipeline_class: Any
    ) -> None:
        self._transformers = list(transformers)
        self._read = _lora_reader(pipeline_class)
        self._sources: dict[str, str] = {}
        self._active: LoraChoice = None
        self.update(adapters)

    @property
    def names(self) -> set[str]:
        return set(self._sources)

    def update(self, adapters: Sequence[Adapter]) -> list[str]:
        """Loads what is new (or has a new source) and drops what is gone; the names
        loaded after."""
        wanted = {a.name: a.source for a in adapters}
        gone = [n for n, source in self._sources.items() if wanted.get(n) != source]
        self._drop(gone)
        loaded: list[str] = []
        try:
            for name, source in wanted.items():
                if name not in self._sources:
                    self._load(name, source)
                    self._sources[name] = source
                    loaded.append(name)
        except Exception:
            # All or nothing: what this call loaded goes too, and the error names why.
            self._drop(loaded)
            raise
        self._active = None
        for transformer in self._transformers:
            # PEFT turns on what it loads; a request without a lora gets the base model.
            if self._sources:
                transformer.disable_lora()
        return sorted(self._sources)

    def _drop(self, names: list[str]) -> None:
        if not names:
            return
        log.info("unloading LoRA adapters %s", ", ".join(names))
        for transformer in self._transformers:
            transformer.delete_adapters(names)
        for name in names:
            del self._sources[name]

    def _load(self, name: str, source: str) -> None:
        log.info("loading LoRA adapter %s from %s", name, source)
        layers, alphas, metadata = self._read(resolve_model_path(source))
        check_fits(name, layers, self._transformers[0])
        for transformer in self._transformers:
            with warnings.catch_warnings():
                # PEFT warns of each adapter after the first: several are the point.
                warnings.filterwarnings("ignore", "Already found a `peft_config`")
                transformer.load_lora_adapter(
                    dict(layers),
                    network_alphas=None if alphas is None else dict(alphas),
                    metadata=None if metadata is None else dict(metadata),
                    adapter_name=name,
                    prefix="transformer",
                )

    def apply(self, choice: LoraChoice) -> None:
        if choice == self._active:
            return
        for transformer in self._transformers:
            if choice is None:
                transformer.disable_lora()
            else:
                transformer.enable_lora()
                transformer.set_adapters([choice[0]], weights=[choice[1]])
        self._active = choice


def check_fits(name: str, layers: Mapping[str, Any], transformer: Any) -> None:
    """Refuses an adapter made for another model: diffusers loads one whose weights name
    no layer of this DiT without a word (a warning at most), and it then changes nothing.
    Every LoRA weight must name a layer this DiT has, and its rank be one a stage loads."""
    prefix = "transformer."
    targets, elsewhere, ranks = set(), [], []
    encoder = [key for key in layers if key.startswith(("text_encoder.", "text_encoder_2."))]
    if encoder:
        raise ValueError(
            f"adapter {name}: {len(encoder)} of its weights are for a text encoder "
            f"(first: {encoder[0]!r}); a stage loads LoRA weights of the DiT only"
        )
    for key, weight in layers.items():
        if not key.startswith(prefix) or ".lora_" not in key:
            elsewhere.append(key)
            continue
        targets.add(key[len(prefix) :].split(".lora_")[0])
        if ".lora_A." in key or ".lora_down." in key:
            ranks.append(int(weight.shape[0]))
    if not layers:
        raise ValueError(f"adapter {name}: no LoRA weights in it")
    modules = {n for n, _ in transformer.named_modules()}
    missing = sorted(t for t in targets if t not in modules)
    if elsewhere or missing:
        example = (elsewhere + missing)[0]
        raise ValueError(
            f"adapter {name}: {len(elsewhere) + len(missing)} of its weights name no layer "
            f"of this model's DiT (first: {example!r}): made for another model?"
        )
    if max(ranks, default=0) > MAX_LORA_RANK:
        raise ValueError(
            f"adapter {name}: LoRA rank {max(ranks)}; a stage loads ranks 1 to {MAX_LORA_RANK}"
        )
