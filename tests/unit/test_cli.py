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
    from omnipipe.worker.stage_classes import unimplemented_stages

    pipeline = load_pipeline(REPO / "examples" / example)
    assert pipeline.stage("thinker").engine.value == "vllm"
    assert unimplemented_stages(pipeline) == []


def render_model(model: str, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["render", model]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"# The OmniPipeline `omnipipe serve {model}` runs")
    doc = yaml.safe_load(out)
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize(
    ("model", "pipeline"),
    [
        ("tiny://qwen-image-edit", "qwen-image-edit"),
        ("tiny://qwen-image-edit-plus", "qwen-image-edit-plus"),
    ],
)
def test_an_edit_checkpoint_is_served_as_its_pipeline_class_says(
    model: str, pipeline: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """QwenImageEditPipeline and QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 and
    -2511's model_index.json) share their components' classes: the pipeline class
    alone tells them apart."""
    assert render_model(model, capsys)["spec"] == {"model": model, "pipeline": pipeline}


def test_render_model_prints_the_pipeline_its_checkpoint_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny:// models are built and then read like any checkpoint: a diffusers pipeline
    by its model_index.json, a transformers model by its config.json."""
    doc = render_model("tiny://qwen-image", capsys)
    assert doc == {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "qwen-image"},
        "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
    }
    kept = tmp_path / "kept.yaml"
    kept.write_text(yaml.safe_dump(doc))
    assert main(["render", str(kept)]) == 0  # the printed file is a valid manifest
    assert "kind: Deployment" in capsys.readouterr().out
    checkpoint = tmp_path / "Qwen3-Omni-30B-A3B-Instruct"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "qwen3_omni_moe"}')
    doc = render_model(str(checkpoint), capsys)
    assert doc["metadata"] == {"name": "qwen3-omni-30b-a3b-instruct"}
    assert doc["spec"] == {"model": str(checkpoint), "pipeline": "qwen3-omni"}


def test_render_model_with_an_unknown_architecture_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["render", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no pipeline for this architecture (llama)" in err
    for known in ("qwen-image (QwenImagePipeline", "qwen2.5-omni (qwen2_5_omni", "qwen3_omni_moe"):
        assert known in err
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "neither a pipeline file nor a model directory" in capsys.readouterr().err
    assert main(["serve", "tiny://nothing"]) == 2
    assert "unknown tiny model 'tiny://nothing'" in capsys.readouterr().err


def test_a_hub_model_that_cannot_be_read_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert main(["serve", "Qwen/Qwen2.5-Omni-7B"]) == 2
    err = capsys.readouterr().err
    assert "Qwen/Qwen2.5-Omni-7B: not a local directory" in err
    assert "could not be read from the Hugging Face Hub" in err


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("Qwen/Qwen2.5-Omni-7B", "qwen2-5-omni-7b"),
        ("tiny://qwen2.5-omni", "qwen2-5-omni"),
        ("/models/2024_image/", "model-2024-image"),
        ("org/" + "x" * 80, "x" * 54),
    ],
)
def test_a_model_names_its_pipeline_with_a_dns_label(model: str, name: str) -> None:
    from omnipipe.api.from_model import pipeline_name_for
    from omnipipe.api.resource import MAX_PIPELINE_NAME

    assert pipeline_name_for(model) == name[:MAX_PIPELINE_NAME]
