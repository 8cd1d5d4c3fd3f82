"""The `omnipipe serve` an AsyncOmni starts for itself: on a port of its own, its output
in a log file, and stopped with the client."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from omnipipe.client.types import OmniError

STOP_SECONDS = 60.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_serve(
    pipeline_file: Path, host: str, port: int
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """`omnipipe serve pipeline_file` in a session of its own, and its open log."""
    # Kept open for the process's life (closed by stop_serve): the serve log, read back
    # when the pipeline fails to start.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix="omnipipe-serve-", suffix=".log", delete=False
    )
    command = [sys.executable, "-m", "omnipipe.cli", "serve", str(pipeline_file)]
    proc = subprocess.Popen(
        [*command, "--host", host, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


def exit_error(proc: subprocess.Popen[bytes], log_path: Path | None) -> OmniError | None:
    """None while it runs; once it has exited, its status and the end of its log."""
    if proc.poll() is None:
        return None
    tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
    return OmniError(f"omnipipe serve exited with status {proc.returncode}:\n{tail}")


def stop_serve(proc: subprocess.Popen[bytes], log: IO[bytes], folder: Path | None) -> None:
    """SIGTERM to `omnipipe serve` (it drains and stops its workers), SIGKILL to its
    whole process group if it has not gone within STOP_SECONDS."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
