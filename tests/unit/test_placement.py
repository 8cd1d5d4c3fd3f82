"""spec.placement: how groups resolve, what they leave alone, and how serve runs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import parse_resource, resolve
from omnipipe.api.loading import load_pipeline, pipeline_yaml
from omnipipe.api.placement import Workload, control_path, workload_of, workloads
from omnipipe.api.revision import pipeline_revision
from omnipipe.local.reload import plan_reload
from omnipipe.worker.threads import group_teams, process_team

REPO = Path(__file__).resolve().parents[2]
GROUPED = REPO / "examples/tiny-image-grouped.yaml"
COLOCATED = REPO / "examples/tiny-omni-colocated.yaml"


def image(**spec: Any) -> Any:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "img"},
                "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image", **spec},
            }
        )
    )


def test_colocated_without_groups_is_one_group_of_every_stage() -> None:
    pipeline = load_pipeline(COLOCATED)
    assert workloads(pipeline) == (Workload("all", ("thinker", "talker", "code2wav"), "all"),)
    assert control_path(workload_of(pipeline, "talker"), "talker") == "/stages/talker"


def test_a_stage_outside_every_group_runs_alone() -> None:
    pipeline = load_pipeline(GROUPED)
    assert workloads(pipeline) == (
        Workload("encode", ("encode",)),
        Workload("pixels", ("denoise", "decode"), "pixels"),
    )
    assert control_path(workload_of(pipeline, "encode"), "encode") == ""


def test_members_take_the_groups_replicas() -> None:
    pipeline = image(
        placement={
            "mode": "colocated",
            "groups": [{"name": "px", "stages": ["denoise", "decode"], "replicas": 3}],
        }
    )
    assert [(s.name, s.replicas) for s in pipeline.stages] == [
        ("encode", 1),
        ("denoise", 3),
        ("decode", 3),
    ]


def test_placement_changes_no_revision_and_disaggregated_files_stay_as_they_were() -> None:
    plain, disaggregated = image(), image(placement={"mode": "disaggregated"})
    colocated = image(placement={"mode": "colocated"})
    assert pipeline_revision(plain) == pipeline_revision(colocated)
    assert "groups" not in pipeline_yaml(plain)
    assert pipeline_yaml(plain) == pipeline_yaml(disaggregated)
    assert "groups" in pipeline_yaml(colocated)


def test_the_resolved_file_keeps_the_groups(tmp_path: Path) -> None:
    """Workers read the snapshot `omnipipe serve` writes, not the user's file."""
    pipeline = load_pipeline(GROUPED)
    snapshot = tmp_path / "pipeline.yaml"
    snapshot.write_text(pipeline_yaml(pipeline))
    assert load_pipeline(snapshot).groups == pipeline.groups


def test_changing_the_placement_under_serve_asks_for_a_restart() -> None:
    plan = plan_reload(image(), image(placement={"mode": "colocated"}))
    assert "placement" in plan.refused


@pytest.mark.parametrize(
    ("total", "cpu", "want"),
    [
        (2, None, {"thinker": 1, "talker": 1, "code2wav": 1}),
        (6, None, {"thinker": 2, "talker": 2, "code2wav": 2}),
        (8, "4", {"thinker": 4, "talker": 2, "code2wav": 2}),
    ],
)
def test_a_groups_threads_are_split_among_its_stages(
    total: int, cpu: str | None, want: dict[str, int]
) -> None:
    pipeline = load_pipeline(COLOCATED)
    if cpu is not None:
        thinker = pipeline.stage("thinker").model_copy(update={"cpu": cpu})
        stages = tuple(thinker if s.name == "thinker" else s for s in pipeline.stages)
        pipeline = pipeline.model_copy(update={"stages": stages})
    teams = group_teams(pipeline, workloads(pipeline)[0].stages, total)
    assert teams == want
    # The process's environment carries the vLLM thinker's team.
    assert process_team(pipeline, teams) == want["thinker"]


def test_a_groups_stages_run_in_stage_order_however_listed() -> None:
    """Members load in stage order (vLLM sizes its cache from what is free), and a
    reordered list is no change to reload."""
    listed = image(
        placement={"mode": "colocated", "groups": [{"name": "px", "stages": ["decode", "denoise"]}]}
    )
    assert listed.groups[0].stages == ("denoise", "decode")
    assert listed == image(
        placement={"mode": "colocated", "groups": [{"name": "px", "stages": ["denoise", "decode"]}]}
    )
