"""The family registry: what it takes from entry points, what it refuses, and the shape
it keeps the code in (a family module is light, families import no other family, no
import cycle, no module over 400 lines)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from omnipipe.api import parse_resource, resolve
from omnipipe.api.families import (
    Family,
    FamilyError,
    PipelineType,
    StageDefaults,
    family_for_checkpoint,
    installed_families,
    register,
)
from omnipipe.api.roles import Engine, Role
from omnipipe.operator.uninstalled import uninstalled_pipeline_type, uninstalled_status
from omnipipe.worker.stage_classes import stage_class
from tests.harness.families import only_families, own_family_names

REPO = Path(__file__).resolve().parents[2]
ENCODE = StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS)


def family(name: str = "one", *pipelines: PipelineType) -> Family:
    """A family whose every pipeline type runs only ENCODE's role and engine."""
    encodes = {(ENCODE.role, ENCODE.engine): "nowhere:Encode"}
    return Family(
        name=name,
        description="",
        pipelines=tuple(
            dataclasses.replace(p, stage_classes=encodes)
            for p in pipelines or (PipelineType(f"{name}-type", "", (ENCODE,)),)
        ),
    )


def test_installed_families_come_from_their_packages_entry_points() -> None:
    families = installed_families()
    assert {n: f.package for n, f in families.items()} == {
        "bagel": "omnipipe",
        "diffusers": "omnipipe",
        "flux": "omnipipe",
        "flux2": "omnipipe",
        "qwen-image": "omnipipe",
        "qwen-omni": "omnipipe",
        "qwen3-tts": "omnipipe",
        "sketch": "omnipipe-sketch",
        "wan": "omnipipe",
        "z-image": "omnipipe",
    }
    assert sorted(own_family_names()) == [
        "bagel",
        "diffusers",
        "flux",
        "flux2",
        "qwen-image",
        "qwen-omni",
        "qwen3-tts",
        "wan",
        "z-image",
    ]
    found = family_for_checkpoint(["omnipipe_sketch"])
    assert found is not None
    assert (found[0].name, found[1].name) == ("sketch", "sketch-image")


def test_omnipipe_families_loads_only_the_families_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with only_families(monkeypatch, ["sketch", "bagel"]):
        assert list(installed_families()) == ["bagel", "sketch"]
    with only_families(monkeypatch, ["bagel", "nope"]), pytest.raises(FamilyError) as err:
        installed_families()
    assert "nope" in str(err.value)
    assert "qwen-image" in str(err.value)


@pytest.mark.parametrize(
    ("families", "says"),
    [
        ([family("one"), family("two", PipelineType("one-type", "", (ENCODE,)))], "already"),
        ([family("one", PipelineType("custom", "", (ENCODE,)))], "reserved"),
        (
            [family("one", PipelineType("t", "", (dataclasses.replace(ENCODE, name="x" * 13),)))],
            "longer than 12",
        ),
        (
            [
                family(
                    "one",
                    PipelineType("t", "", (StageDefaults("d", Role.DENOISER, Engine.DIFFUSERS),)),
                )
            ],
            "does not say it runs",
        ),
        ([family("one"), dataclasses.replace(family("one"), pipelines=())], "already installed"),
        (
            [
                Family(
                    "one",
                    "",
                    (
                        PipelineType(
                            "t",
                            "",
                            (ENCODE,),
                            stage_classes={(ENCODE.role, ENCODE.engine): "Encode"},
                        ),
                    ),
                )
            ],
            "is 'Encode', not a \"module:Class\" string",
        ),
        (
            [
                family("one", PipelineType("a", "", (ENCODE,), checkpoints=("Marker",))),
                family("two", PipelineType("b", "", (ENCODE,), checkpoints=("Marker",))),
            ],
            "checkpoint marker 'Marker' is already family 'one'",
        ),
        (
            [
                dataclasses.replace(family("one"), tiny_models={"t": "m:f"}),
                dataclasses.replace(family("two"), tiny_models={"t": "m:g"}),
            ],
            "tiny model 't' is already family 'one'",
        ),
    ],
)
def test_a_family_that_would_clash_or_break_a_name_is_refused(
    families: list[Family], says: str
) -> None:
    with pytest.raises(FamilyError) as err:
        register((f.name, "pkg", f) for f in families)
    assert says in str(err.value)
    assert "pkg" in str(err.value)


def test_an_entry_point_that_is_no_family_is_refused() -> None:
    with pytest.raises(FamilyError) as err:
        register([("broken", "pkg", object())])
    assert "not an omnipipe Family" in str(err.value)


def test_a_family_module_imports_only_api_as_the_router_and_operator_load_it() -> None:
    probe = (
        "import sys, omnipipe.families.qwen_image, omnipipe.families.qwen_omni, "
        "omnipipe.families.bagel, omnipipe.families.bagel.requests, omnipipe_sketch\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', "
        "'transformers', 'vllm') or m.startswith(('omnipipe.worker', 'omnipipe.router', "
        "'omnipipe.operator')))\n"
        "print(heavy)"
    )
    assert printed_by(probe) == "[]"


def test_serve_checks_a_pipeline_against_the_families_without_loading_torch() -> None:
    """`omnipipe serve` asks which stages no family runs before it starts anything: that
    check costs no torch import (about a CPU-second and 400 MB in every serve process)."""
    probe = (
        "import sys\n"
        "from omnipipe.api import parse_resource, resolve\n"
        "from omnipipe.worker.stage_classes import unimplemented_stages\n"
        "doc = {'apiVersion': 'omnipipe.io/v1alpha1', 'kind': 'OmniPipeline', "
        "'metadata': {'name': 'p'}, 'spec': {'model': 'tiny://qwen-image', "
        "'pipeline': 'qwen-image'}}\n"
        "assert unimplemented_stages(resolve(parse_resource(doc))) == []\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert printed_by(probe) == "[]"


def printed_by(probe: str) -> str:
    """What `probe` prints, run in a fresh interpreter (its imports are its own)."""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip()


def test_no_import_cycle_and_no_family_module_over_400_lines() -> None:
    graph = grimp.build_graph("omnipipe", exclude_type_checking_imports=True)
    cycles = [
        (module, imported)
        for module in graph.modules
        for imported in graph.find_modules_directly_imported_by(module)
        if imported != module and graph.chain_exists(importer=imported, imported=module)
    ]
    assert cycles == []
    long = [
        f"{p.relative_to(REPO)}: {n}"
        for p in sorted((REPO / "omnipipe/families").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert long == []


def test_a_type_no_installed_family_registers_is_stalled_naming_them() -> None:
    body = {"spec": {"model": "m", "pipeline": "sketch-video"}}
    assert uninstalled_pipeline_type(body) == "sketch-video"
    assert uninstalled_pipeline_type({"spec": {"pipeline": "sketch-image"}}) is None
    assert uninstalled_pipeline_type({"spec": {"pipeline": "custom"}}) is None
    status = uninstalled_status("sketch-video", 3, [], "2026-11-25T00:00:00Z")
    conditions = {c.type: c for c in status.conditions}
    assert [c.type for c in status.conditions] == ["Ready", "Reconciling", "Stalled"]
    assert conditions["Stalled"].status == "True"
    assert conditions["Ready"].status == conditions["Reconciling"].status == "False"
    assert "bagel (bagel)" in conditions["Stalled"].message
    assert status.observed_generation == 3
    again = uninstalled_status("sketch-video", 4, status.conditions, "2026-11-25T01:00:00Z")
    assert again.conditions[2].last_transition_time == "2026-11-25T00:00:00Z"


def _checkpoint(directory: Path, model_type: str) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(directory)


def test_a_worker_names_what_no_installed_family_runs(tmp_path: Path) -> None:
    unknown = _checkpoint(tmp_path / "unknown", "nobodys_model")
    custom = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "custom"},
                "spec": {
                    "model": "some/model",
                    "pipeline": "custom",
                    "stages": [
                        {"name": "encode", "role": "text-encoder", "engine": "transformers"},
                        {"name": "think", "role": "thinker", "engine": "vllm"},
                    ],
                },
            }
        )
    )
    stage, thinker = custom.stage("encode"), custom.stage("think")
    with pytest.raises(NotImplementedError) as err:
        stage_class(stage, unknown)
    assert "no installed family runs this checkpoint (nobodys_model)" in str(err.value)
    assert "sketch (sketch-image)" in str(err.value)
    sketch = _checkpoint(tmp_path / "sketch", "omnipipe_sketch")
    with pytest.raises(NotImplementedError) as err:
        stage_class(thinker, sketch)
    assert "the sketch family" in str(err.value)
    assert "not thinker on vllm" in str(err.value)
    assert stage_class(stage, sketch).__name__ == "SketchEncode"


def test_one_type_at_most_runs_any_diffusers_checkpoint() -> None:
    """Two catch-alls would leave it to load order which serves an unclaimed checkpoint."""
    catch_all = PipelineType("any", "", (ENCODE,), any_diffusers_checkpoint=True)
    other = dataclasses.replace(catch_all, name="any-2")
    with pytest.raises(FamilyError, match="runs any diffusers checkpoint, which family 'one'"):
        register([("one", "p", family("one", catch_all)), ("two", "q", family("two", other))])
    assert set(register([("one", "p", family("one", catch_all))])) == {"one"}


def test_a_type_with_request_extensions_of_its_own_is_checked_by_them() -> None:
    """The fallback's types take different requests (an image, a video, a clip of audio),
    so each names its own extensions; a type that names none has its family's."""
    from omnipipe.api.families import load_installed, requests_of

    here = "omnipipe.families.diffusers_any"
    assert requests_of("diffusers") == f"{here}.requests:EXTENSIONS"
    assert requests_of("diffusers-video") == f"{here}.video_requests:EXTENSIONS"
    assert requests_of("diffusers-audio") == f"{here}.audio_requests:EXTENSIONS"
    assert requests_of("wan") == "omnipipe.families.wan.requests:EXTENSIONS"
    assert requests_of("no-such-type") is None
    assert "diffusers" in load_installed()
