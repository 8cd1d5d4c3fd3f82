"""A colocated group's threads: in a pod, where no --threads is given, the process's budget
is the CPUs it may use, split among its stages, and it survives the process-wide team the
worker puts in the environment; in the running group, each stage's engine thread keeps
its own team (torch's OpenMP team size is per thread)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from omnipipe.api import load_file, resolve
from omnipipe.api.placement import workloads
from omnipipe.cli import main
from omnipipe.local.ports import free_port
from omnipipe.worker import threads
from omnipipe.worker.group import build_group_app
from omnipipe.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
COLOCATED = REPO / "examples/tiny-omni-colocated.yaml"
GROUPED = REPO / "examples/tiny-image-grouped.yaml"

pytestmark = pytest.mark.timeout(300)


def test_a_pod_group_with_no_threads_flag_splits_the_cpus_it_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`omnipipe worker --group all` as the operator's pod runs it: no --threads."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 6)
    started: dict[str, Any] = {}
    monkeypatch.setattr(threads, "apply_thread_budget", lambda n: started.update(process=n))
    monkeypatch.setattr("omnipipe.worker.main.run_worker", lambda s: started.update(settings=s))
    assert main(["worker", "--pipeline", str(COLOCATED), "--group", "all"]) == 0

    pipeline = resolve(load_file(COLOCATED))
    [group] = workloads(pipeline)
    teams = threads.group_teams(pipeline, group.stages, 6)
    assert sum(teams.values()) == 6
    assert set(teams) == {"thinker", "talker", "code2wav"}
    # The environment every thread starts with is the vLLM thinker's team ...
    assert started["process"] == teams["thinker"] < 6
    # ... and the group's budget was pinned before it was: the worker reads it again
    # after the environment says OMP_NUM_THREADS=<the thinker's team>.
    settings: WorkerSettings = started["settings"]
    assert settings.threads == 6
    monkeypatch.setenv("OMP_NUM_THREADS", str(started["process"]))
    assert threads.group_teams(pipeline, group.stages, threads.group_budget(settings.threads)) == (
        teams
    )


def test_the_launchers_threads_flag_is_the_groups_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # a stage's env: below the launcher's word
    monkeypatch.setattr(threads, "usable_cpus", lambda: 6)
    assert threads.group_budget(2) == 2
    assert threads.group_budget(None) == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.group_budget(None) == 6


@pytest.mark.parametrize("after_vllm", [False, True], ids=["alone", "after-a-vllm-stage"])
def test_each_stage_of_a_running_group_keeps_its_own_team(
    after_vllm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if after_vllm:
        # What vLLM's CPU worker does to the whole process once it binds its threads
        # (vllm/v1/worker/cpu_worker.py, init_device): stages loaded after it in the same
        # group must still get their own team.
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    pipeline = resolve(load_file(GROUPED))
    [group] = [w for w in workloads(pipeline) if w.group == "pixels"]
    teams = {"denoise": 2, "decode": 1}
    ports = (free_port(), free_port())
    settings = WorkerSettings(
        pipeline_file=str(GROUPED), group="pixels", transfer_ports=ports, drain_timeout_seconds=1
    )
    before = torch.get_num_threads()
    app = build_group_app(pipeline, settings, group, ports, teams)
    with TestClient(app) as client:
        seen = {
            state.settings.stage: client.portal.call(
                state.runtime.between_batches, torch.get_num_threads
            )
            for state in app.state.group
        }
    assert seen == teams
    assert torch.get_num_threads() == before  # the test's own thread is untouched
