"""`omnipipe serve` hands one credential per run to the router and every worker."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import load_file, resolve
from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.local import supervisor
from omnipipe.local.forks import FORKS_ENV, WorkerForks

REPO = Path(__file__).resolve().parents[2]


class FakePopen:
    def __init__(self, argv: list[str], env: dict[str, str], **_: Any) -> None:
        self.argv, self.env = argv, env
        self.pid = 0


def _spawned(monkeypatch: pytest.MonkeyPatch) -> tuple[supervisor.Supervisor, list[FakePopen]]:
    spawned: list[FakePopen] = []

    def popen(argv: list[str], **kwargs: Any) -> FakePopen:
        spawned.append(FakePopen(argv, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    # Every child started, none forked (test_worker_forks.py forks real ones): the
    # environment a fork is given is the one checked here (the next test).
    monkeypatch.setenv(FORKS_ENV, "0")
    example = REPO / "examples/tiny-text-to-image.yaml"
    sup = supervisor.Supervisor(resolve(load_file(example)), example)
    sup.start()
    return sup, spawned


@pytest.mark.timeout(30)
def test_router_and_every_worker_get_the_same_fresh_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CREDENTIAL_ENV, raising=False)
    sup, spawned = _spawned(monkeypatch)
    assert len(spawned) == len(sup.children) >= 4  # three stages and the router
    assert any("router" in p.argv for p in spawned)
    credentials = {p.env[CREDENTIAL_ENV] for p in spawned}
    assert credentials == {sup.credential}
    assert len(sup.credential) >= 32
    # Never on a command line, where other users of the machine can read it.
    assert all(sup.credential not in " ".join(p.argv) for p in spawned)
    assert sup.credential not in repr(sup)
    # A second run draws a new one.
    again, _ = _spawned(monkeypatch)
    assert again.credential != sup.credential


@pytest.mark.timeout(30)
def test_a_forked_worker_is_given_the_environment_a_started_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[list[str], dict[str, str]]] = []

    def start(self: WorkerForks, argv: list[str], env: dict[str, str]) -> None:
        asked.append((argv, env))  # and none forked: each is started as well

    monkeypatch.setattr(WorkerForks, "start", start)
    sup, spawned = _spawned(monkeypatch)
    workers = [p for p in spawned if "worker" in p.argv]
    assert len(asked) == len(workers) == 3
    assert [argv for argv, _ in asked] == [p.argv for p in workers]
    assert [env for _, env in asked] == [p.env for p in workers]
    assert all(env[CREDENTIAL_ENV] == sup.credential for _, env in asked)


@pytest.mark.timeout(30)
def test_an_exported_credential_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CREDENTIAL_ENV, "chosen-by-the-user")
    sup, spawned = _spawned(monkeypatch)
    assert sup.credential == "chosen-by-the-user"
    assert {p.env[CREDENTIAL_ENV] for p in spawned} == {"chosen-by-the-user"}


@pytest.mark.timeout(30)
def test_workers_put_large_tensors_in_huge_pages_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch reads THP_MEM_ALLOC_ENABLE once, at start: it must be in each child's
    environment (UCX copies hugepage-backed tensors between workers twice as fast)."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    _, spawned = _spawned(monkeypatch)
    assert {p.env["THP_MEM_ALLOC_ENABLE"] for p in spawned} == {"1"}
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    _, spawned = _spawned(monkeypatch)
    assert {p.env["THP_MEM_ALLOC_ENABLE"] for p in spawned} == {"0"}
