"""Workers forked from a process that has already imported torch, diffusers and
transformers (a fork server), instead of each importing them afresh: 4.8 of a worker's
6.2 CPU-seconds to ready are those imports (docs/design/worker-fork-server.md).

serve side: `WorkerForks.start(argv, env)` gives a `ForkedProcess`, or None where no fork
server can take the worker (then serve starts it as before). Server side (the
`omnipipe.fork_server` process): `serve_requests` answers serve's requests and returns
only in a forked worker, with what the worker runs.

A worker's parent is `serve` itself, as a started one's is: the fork server forks twice,
the middle process exits, and the worker is reparented to `serve`, a child subreaper
(PR_SET_CHILD_SUBREAPER), which waits for it, signals it and reads its exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from omnipipe.local.children import PR_SET_PDEATHSIG, die_with_parent

PR_SET_CHILD_SUBREAPER = 36
# Off with 0: every worker starts as a fresh interpreter.
FORKS_ENV = "OMNIPIPE_SERVE_FORK_WORKERS"
READY_TIMEOUT_SECONDS = 180.0
FORK_TIMEOUT_SECONDS = 30.0


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    return bool(libc.prctl(option, value) == 0)


def become_subreaper() -> bool:
    """Orphaned descendants (the forked workers) become this process's children."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


class ForkedProcess:
    """A forked worker, as serve drives a subprocess.Popen: it is serve's own child."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Not ours to wait for (it cannot be: the fork server waits for the
                # middle process before it answers); gone either way.
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkLost(RuntimeError):
    """A fork asked for and not answered: a worker may run that serve does not know, on
    the ports it would start another on. serve stops (RuntimeError), and the worker with
    it (its parent-death signal)."""


class ForkServer:
    """One `omnipipe.fork_server` process, for workers of one thread budget: OpenMP sizes
    its teams once, when torch loads, so a fork inherits the budget it was loaded with."""

    def __init__(self, threads: int, env: dict[str, str]) -> None:
        self.threads = threads
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnipipe.fork_server", "--socket-fd", str(theirs.fileno())],
            env={**env, "OMNIPIPE_FORK_SERVER_THREADS": str(threads)},
            pass_fds=(theirs.fileno(),),
            preexec_fn=die_with_parent,
            start_new_session=True,
        )
        theirs.close()
        self.replies: IO[str] = ours.makefile("r", encoding="utf-8")
        self.ready = False

    def _reply(self, timeout: float) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        line = self.replies.readline()
        if not line:
            raise OSError(f"the fork server exited (code {self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def fork(self, args: list[str], env: dict[str, str]) -> int:
        """A worker running `omnipipe ARGS` with ENV; its pid. OSError or ValueError
        before the request left: no worker was forked, start it another way. A request
        sent and not answered may have forked one that holds its ports: ForkLost."""
        if not self.ready:
            self.ready = bool(self._reply(READY_TIMEOUT_SECONDS).get("ready"))
        self.sock.sendall((json.dumps({"args": args, "env": env}) + "\n").encode())
        try:
            reply = self._reply(FORK_TIMEOUT_SECONDS)
        except (OSError, ValueError) as exc:
            raise ForkLost(f"the fork server did not answer a fork: {exc}") from exc
        if "pid" not in reply:
            raise OSError(f"the fork server could not fork: {reply.get('error', reply)}")
        return int(reply["pid"])

    def close(self) -> None:
        """The socket's end is the fork server's: it exits when it reads it."""
        with contextlib.suppress(OSError):
            self.replies.close()  # the file holds the socket open too
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class WorkerForks:
    """serve's fork servers, one per thread budget, started at the first worker of it."""

    enabled: bool = field(default_factory=lambda: os.environ.get(FORKS_ENV, "1") != "0")
    servers: dict[int, ForkServer] = field(default_factory=dict)
    reaping: bool = False

    def start(self, argv: list[str], env: dict[str, str]) -> ForkedProcess | None:
        """`argv` (python -m omnipipe.cli worker ...) forked, or None: a group's worker
        or one without --threads (its budget is known only inside it), or a fork server
        that failed (said once; its workers then start as before)."""
        if not self.enabled or "--group" in argv or "--threads" not in argv:
            return None
        if not self.reaping:
            # At the first fork, not before: a Supervisor made and never started (a test's)
            # leaves its process as it was.
            self.reaping = self.enabled = become_subreaper()
            if not self.enabled:
                return None
        threads = int(argv[argv.index("--threads") + 1])
        try:
            self.prepare([threads], env)
            pid = self.servers[threads].fork(argv[3:], env)
        except (OSError, ValueError) as exc:
            print(f"omnipipe: workers start without a fork server from now on: {exc}", flush=True)
            self.enabled = False
            self.close()
            return None
        return ForkedProcess(pid, argv)

    def prepare(self, budgets: Iterable[int], env: dict[str, str]) -> None:
        """Start the fork servers of these thread budgets, not waiting for them: serve
        starts every budget's before its first fork, so that they import side by side."""
        if not self.enabled:
            return
        for threads in budgets:
            if threads not in self.servers:
                self.servers[threads] = ForkServer(threads, env)

    def pids(self) -> set[int]:
        return {server.proc.pid for server in self.servers.values()}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()
        if self.reaping:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)
            self.reaping = False


def _children() -> set[int]:
    """This process's children, as the kernel lists them for each of its threads."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            found.update(
                int(pid) for pid in Path(f"/proc/self/task/{task}/children").read_text().split()
            )
    return found


def reap_orphans(known: set[int]) -> None:
    """Reap the exited processes serve adopted as a subreaper (a crashed worker's own
    children, say) and knows nothing of; a process of `known` is left to whoever waits
    for it, with its exit code."""
    for pid in _children() - known:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@dataclass(frozen=True)
class Job:
    """What a forked worker runs: `omnipipe ARGS` with ENV."""

    args: list[str]
    env: dict[str, str]


def _become_worker(job: Job, middle: int, serve: int) -> Job:
    """In the forked worker: once reparented to serve, die with it, as a started one does."""
    while os.getppid() == middle:
        time.sleep(0.001)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != serve:
        os._exit(1)  # serve died before the signal was armed
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(job.env)
    sys.argv = ["omnipipe", *job.args]
    return job


def serve_requests(sock: socket.socket) -> Job:
    """Answer serve's fork requests until it closes the socket (then exit); returns only
    in a forked worker."""
    serve = os.getppid()
    requests = sock.makefile("r", encoding="utf-8")
    sock.sendall(b'{"ready": true}\n')
    for line in requests:
        request = json.loads(line)
        if (threads := threading.active_count()) != 1:
            # A Python thread may hold a lock (the import lock, logging's) that the fork
            # copies held, with no thread in the worker to free it. Native pools are let
            # be: OpenBLAS's (numpy starts it at import with a budget over 1) stops
            # itself around a fork (pthread_atfork), and OpenMP's starts at the first
            # parallel region, which the fork server never runs.
            error = f"{threads} Python threads; a fork needs one"
            sock.sendall((json.dumps({"error": error}) + "\n").encode())
            continue
        job = Job(
            [str(a) for a in request["args"]], {str(k): str(v) for k, v in request["env"].items()}
        )
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(read_end)
            os.setsid()
            me = os.getpid()
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                requests.close()
                sock.close()
                return _become_worker(job, me, serve)
            os.write(write_end, str(worker).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            answer = pipe.read().decode()
        os.waitpid(middle, 0)
        reply = {"pid": int(answer)} if answer.isdigit() else {"error": "the fork failed"}
        sock.sendall((json.dumps(reply) + "\n").encode())
    sys.exit(0)
