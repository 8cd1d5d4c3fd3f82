from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnipipe.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_render_prints_every_child(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(REPO / "examples/qwen-image.yaml"), "-n", "team-a"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    [rev] = {d["metadata"]["labels"].get("omnipipe.io/revision") for d in docs} - {None}
    stages = ("encode", "denoise", "decode")
    assert kinds == sorted(
        [
            ("ConfigMap", f"qwen-image-config-{rev}"),
            ("NetworkPolicy", "qwen-image-stages"),
            ("Deployment", "qwen-image-router"),
            ("Service", "qwen-image-router"),
            *[("Deployment", f"qwen-image-{s}-{rev}") for s in stages],
            *[("Service", f"qwen-image-{s}") for s in stages],
        ]
    )
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}


def test_render_bad_file_exits_2_with_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: x}\n"
        "spec: {pipeline: qwen-image}\n"
    )
    assert main(["render", str(bad)]) == 2
    assert "spec.model: Field required" in capsys.readouterr().err


def test_crd_command_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "CustomResourceDefinition"


def test_serve_refuses_stages_it_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    custom = tmp_path / "custom.yaml"
    custom.write_text(
        "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: x}\n"
        "spec:\n  model: tiny://qwen-image\n  pipeline: custom\n  stages:\n"
        "    - {name: denoise, role: denoiser, engine: vllm}\n"
    )
    assert main(["serve", str(custom)]) == 2
    assert "cannot run these stages yet: denoise (denoiser on vllm)" in capsys.readouterr().err


@pytest.mark.parametrize("example", ["qwen2.5-omni.yaml", "qwen3-omni.yaml"])
def test_the_real_omni_examples_have_no_stage_serve_cannot_run(example: str) -> None:
    """Their thinkers are declared on vLLM, which the worker drives."""
    from omnipipe.api.loading import load_pipeline
    from omnipipe.worker.stages import unimplemented_stages

    pipeline = load_pipeline(REPO / "examples" / example)
    assert pipeline.stage("thinker").engine.value == "vllm"
    assert unimplemented_stages(pipeline) == []
