"""Start the router and every stage's workers as child processes with static discovery,
show readiness progress, and take them all down together."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from omnipipe.api import ResolvedPipeline
from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.local.ports import free_port

STOP_GRACE_SECONDS = 15.0


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
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


RESTART_WINDOW_SECONDS = 60.0
MAX_RESTARTS_IN_WINDOW = 5


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    ready_url: str
    argv: list[str]
    # A crashed worker is restarted like a Deployment would; the router is not.
    restartable: bool
    restarts: list[float] = field(default_factory=list)


@dataclass
class Supervisor:
    pipeline: ResolvedPipeline
    pipeline_file: Path
    host: str = "127.0.0.1"
    port: int = 8000
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    credential: str = field(default_factory=pipeline_credential, repr=False)

    def _popen(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            # In the environment, not argv: other users can read a process's arguments.
            env={**os.environ, "PYTHONUNBUFFERED": "1", CREDENTIAL_ENV: self.credential},
            preexec_fn=_die_with_parent,
            # Children take signals from us, not from a terminal's Ctrl-C to the group,
            # so they stop in order: drain first, then exit.
            start_new_session=True,
        )

    def _spawn(self, name: str, args: list[str], ready_url: str, restartable: bool) -> None:
        argv = [sys.executable, "-m", "omnipipe.cli", *args]
        self.children.append(Child(name, self._popen(argv), ready_url, argv, restartable))

    def start(self) -> None:
        replicas: dict[str, list[str]] = {}
        for stage in self.pipeline.stages:
            # Local mode has no autoscaler to wake a stage: run at least one replica.
            for i in range(max(stage.replicas, 1)):
                control, transfer = free_port(self.host), free_port(self.host)
                url = f"http://{self.host}:{control}"
                replicas.setdefault(stage.name, []).append(url)
                self._spawn(
                    f"{stage.name}-{i}",
                    [
                        "worker",
                        "--pipeline",
                        str(self.pipeline_file),
                        "--stage",
                        stage.name,
                        "--host",
                        self.host,
                        "--port",
                        str(control),
                        "--transfer-port",
                        str(transfer),
                        "--advertise-host",
                        self.host,
                    ],
                    f"{url}/ready",
                    restartable=True,
                )
        discovery = Path(tempfile.mkdtemp(prefix="omnipipe-")) / "replicas.json"
        discovery.write_text(json.dumps(replicas))
        self._spawn(
            "router",
            [
                "router",
                "--pipeline",
                str(self.pipeline_file),
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--replicas-file",
                str(discovery),
            ],
            f"http://{self.host}:{self.port}/ready",
            restartable=False,
        )

    @staticmethod
    def _is_ready(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _check_alive(self) -> None:
        for child in self.children:
            code = child.proc.poll()
            if code is None or self.stopping:
                continue
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_SECONDS]
            if not child.restartable or len(child.restarts) >= MAX_RESTARTS_IN_WINDOW:
                raise RuntimeError(f"{child.name} exited with code {code}")
            child.restarts.append(now)
            if "--transfer-port" in child.argv:
                # UCX cannot rebind a port its predecessor just held; the router learns
                # the new transfer address from the worker's /ready.
                at = child.argv.index("--transfer-port") + 1
                child.argv[at] = str(free_port(self.host))
            child.proc = self._popen(child.argv)
            print(
                f"omnipipe: {child.name} exited with code {code}; restarting as pid "
                f"{child.proc.pid} ({len(child.restarts)}/{MAX_RESTARTS_IN_WINDOW} in "
                f"{RESTART_WINDOW_SECONDS:.0f}s)",
                flush=True,
            )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        shown: set[str] = set()
        total = len(self.children)
        while time.monotonic() < deadline:
            self._check_alive()
            for child in self.children:
                if child.name not in shown and self._is_ready(child.ready_url):
                    shown.add(child.name)
                    base = child.ready_url.removesuffix("/ready")
                    print(
                        f"  [{len(shown)}/{total}] {child.name} ready at {base} "
                        f"(pid {child.proc.pid})",
                        flush=True,
                    )
            if len(shown) == total:
                return
            time.sleep(0.25)
        waiting = [c.name for c in self.children if c.name not in shown]
        raise RuntimeError(f"not ready after {timeout:.0f}s: {', '.join(waiting)}")

    def stop(self) -> None:
        self.stopping = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def run_forever(self) -> None:
        while True:
            self._check_alive()
            time.sleep(0.5)


def serve(
    pipeline: ResolvedPipeline, pipeline_file: Path, host: str, port: int, ready_timeout: float
) -> int:
    sup = Supervisor(pipeline, pipeline_file, host, port)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a shell without job control starts background jobs with
    # SIGINT ignored, and Python keeps an inherited "ignore".
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    workers = sum(max(s.replicas, 1) for s in pipeline.stages)
    print(
        f"omnipipe: serving {pipeline.name} ({pipeline.pipeline}, model {pipeline.model}): "
        f"{workers} worker(s) for {len(pipeline.stages)} stage(s) + router",
        flush=True,
    )
    try:
        sup.start()
        sup.wait_ready(ready_timeout)
        print(
            f"omnipipe: ready. OpenAI base URL: http://{host}:{port}/v1  "
            f"(model: {pipeline.name}; Ctrl-C to stop)",
            flush=True,
        )
        sup.run_forever()
    except KeyboardInterrupt:
        print("omnipipe: stopping", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"omnipipe: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        sup.stop()
    return 0
