"""The Redis a video pipeline's router keeps its jobs in, under `omnipipe serve`: a
redis-server of its own on loopback, unless OMNIPIPE_ROUTER_VIDEO_STORE names one (a
second router, or one the user runs). Nothing is saved to disk: jobs last while it runs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api.families import pipeline_types
from omnipipe.local.children import die_with_parent

VIDEO_STORE_ENV = "OMNIPIPE_ROUTER_VIDEO_STORE"
START_TIMEOUT_SECONDS = 10.0


def needs_video_store(pipeline: ResolvedPipeline) -> bool:
    kind = pipeline_types().get(pipeline.pipeline)
    return kind is not None and kind.makes_video and not os.environ.get(VIDEO_STORE_ENV)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(folder: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on 127.0.0.1:port, answering; and its URL."""
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError(
            "this pipeline makes videos, whose jobs the router keeps in Redis: install "
            f"redis-server (apt-get install redis-server), or set {VIDEO_STORE_ENV}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    argv = [server, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder)]
    argv += ["--save", "", "--appendonly", "no", "--protected-mode", "yes"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server on port {port} did not start ({' '.join(argv)})")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"
