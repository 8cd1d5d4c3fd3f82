"""The processes `omnipipe serve` starts: how each is described, and what every one of
them is given."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
from dataclasses import dataclass, field
from typing import Protocol

from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.api.placement import STAGE_PATH_PREFIX

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if `omnipipe serve` dies, even by SIGKILL,
    so no worker outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def pipeline_credential() -> str:
    """One credential per run, shared by the router and every worker: the control API and
    the transfer listeners refuse whoever lacks it. An exported OMNIPIPE_PIPELINE_CREDENTIAL
    is used instead, so that a tool may call the workers itself."""
    return os.environ.get(CREDENTIAL_ENV) or secrets.token_urlsafe(32)


class Process(Protocol):
    """What serve asks of a child process: a subprocess.Popen, or a forked worker
    (local/forks.py ForkedProcess)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Child:
    name: str
    proc: Process
    ready_url: str
    argv: list[str]
    # A crashed worker is restarted like a Deployment would; the router is not.
    restartable: bool
    restarts: list[float] = field(default_factory=list)
    stage: str | None = None  # None for the router; a colocated group's name for its workers
    revision: str = ""
    # Started by a reload that has not switched to it yet: a crash fails the reload
    # instead of being restarted.
    pending: bool = False

    # The stages it runs: (stage,) for a stage's worker; a colocated group's members.
    members: tuple[str, ...] = ()
    colocated: bool = False

    @property
    def url(self) -> str:
        return self.ready_url.removesuffix("/ready")

    def runs(self, stage: str) -> bool:
        return stage in self.members

    def stage_url(self, stage: str) -> str:
        """The stage's control API: the root, or /stages/<stage> in a colocated group."""
        return f"{self.url}{STAGE_PATH_PREFIX}{stage}" if self.colocated else self.url
