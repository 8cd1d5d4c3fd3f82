"""The Redis a video pipeline's router keeps its jobs in (and a voice-cloning pipeline's
router its uploaded voices), under `omnipipe serve`: a redis-server of its own, unless
OMNIPIPE_ROUTER_VIDEO_STORE names one (a second router, or one the user runs). It listens
on a unix socket in a folder only this user may open, not on a TCP port any local user
could reach. Nothing is saved to disk: jobs and voices last while it runs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api.constants import VIDEO_STORE_ENV
from omnipipe.api.pipeline_traits import makes_video, needs_store
from omnipipe.local.children import die_with_parent

START_TIMEOUT_SECONDS = 10.0


def needs_video_store(pipeline: ResolvedPipeline) -> bool:
    """A video pipeline needs the store; a voice-cloning one keeps uploaded voices in it
    where redis-server is installed, and serves speech without it."""
    if not needs_store(pipeline.pipeline) or os.environ.get(VIDEO_STORE_ENV):
        return False
    return makes_video(pipeline.pipeline) or shutil.which("redis-server") is not None


def _answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect(str(path))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on the unix socket folder/redis.sock, answering; and its URL."""
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError(
            "this pipeline makes videos, whose jobs the router keeps in Redis: install "
            f"redis-server (apt-get install redis-server), or set {VIDEO_STORE_ENV}"
        )
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / "redis.sock"
    argv = [server, "--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700"]
    argv += ["--dir", str(folder), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not _answers(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server on {path} did not start ({' '.join(argv)})")
        time.sleep(0.05)
    return proc, f"unix://{path}?db=0"
