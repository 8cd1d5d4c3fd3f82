"""`omnipipe serve`'s workers forked from a fork server (omnipipe/local/forks.py): the
worker is serve's own child, with the environment it was given, its exit code reaches
serve, and a fork server that cannot fork safely sends serve back to starting them.

Each case runs in a process of its own: the fork makes that process a child subreaper,
which the test session must not become."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SERVE_SIDE = textwrap.dedent(
    """
    import json, os, sys, time
    from omnipipe.local.forks import WorkerForks

    forks = WorkerForks()
    argv = [sys.executable, "-m", "omnipipe.cli", *sys.argv[1:]]
    env = {**os.environ, "OMNIPIPE_PIPELINE_CREDENTIAL": "secret-of-this-run"}
    proc = forks.start(argv, env)
    result = {"forked": proc is not None}
    if proc is not None:
        with open(f"/proc/{proc.pid}/status") as status:
            ppid = next(int(l.split()[1]) for l in status if l.startswith("PPid:"))
        result.update(parent_is_serve=ppid == os.getpid(), code=proc.wait(60))
        result["second"] = forks.start(argv, env).wait(60)
    forks.close()
    result["fork_servers_left"] = [s.proc.poll() for s in forks.servers.values()]
    print(json.dumps(result))
    """
)


def serve_side(*args: str, env: dict[str, str] | None = None) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", SERVE_SIDE, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_forked_worker_is_serves_child_and_its_exit_code_reaches_serve() -> None:
    # A worker that cannot read its pipeline file exits 2, saying so.
    result, stderr = serve_side(
        "worker", "--pipeline", "/no/such/pipeline.yaml", "--stage", "s", "--threads", "1"
    )
    assert result == {
        "forked": True,
        "parent_is_serve": True,
        "code": 2,
        "second": 2,
        "fork_servers_left": [],
    }
    assert stderr.count("/no/such/pipeline.yaml: No such file or directory") == 2


def test_off_by_the_environment_and_for_a_worker_without_a_thread_budget() -> None:
    args = ("worker", "--pipeline", "/no/such/pipeline.yaml", "--stage", "s")
    assert serve_side(*args, "--threads", "1", env={"OMNIPIPE_SERVE_FORK_WORKERS": "0"})[0] == {
        "forked": False,
        "fork_servers_left": [],
    }
    assert serve_side(*args)[0] == {"forked": False, "fork_servers_left": []}
