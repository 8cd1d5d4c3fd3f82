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

import pytest

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
    servers = list(forks.servers.values())
    forks.close()
    result["fork_servers"] = len(servers)
    result["fork_servers_left"] = [s.proc.pid for s in servers if s.proc.poll() is None]
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
        "fork_servers": 1,  # both forked from one: the same thread budget
        "fork_servers_left": [],  # and it exited when serve closed its socket
    }
    assert stderr.count("/no/such/pipeline.yaml: No such file or directory") == 2


def test_off_by_the_environment_and_for_a_worker_without_a_thread_budget() -> None:
    args = ("worker", "--pipeline", "/no/such/pipeline.yaml", "--stage", "s")
    off = {"forked": False, "fork_servers": 0, "fork_servers_left": []}
    assert serve_side(*args, "--threads", "1", env={"OMNIPIPE_SERVE_FORK_WORKERS": "0"})[0] == off
    assert serve_side(*args)[0] == off


OPENMP_TEAM = textwrap.dedent(
    """
    import json, os, socket, sys, threading
    from omnipipe.local.forks import become_subreaper, serve_requests
    from omnipipe.worker.threads import budget_environment

    budget = int(sys.argv[1])
    assert become_subreaper()
    ours, theirs = socket.socketpair()
    if os.fork() == 0:  # the fork server, as omnipipe/fork_server.py starts it
        ours.close()
        os.environ.update(budget_environment(budget))
        import numpy, torch  # numpy's OpenBLAS starts its pool at import (budget > 1)
        job = serve_requests(theirs)
        # The forked worker: the team of a thread it starts, as the engine thread is
        # started, before anything sets it, and a parallel region on it.
        seen = []
        def engine():
            seen.append(torch.get_num_threads())
            x = torch.ones(512, 512)
            seen.append(float((x @ x).sum()))
            seen.append(float(numpy.ones((64, 64)).dot(numpy.ones((64, 64))).sum()))
        t = threading.Thread(target=engine)
        t.start()
        t.join()
        print(json.dumps(seen), flush=True)
        os._exit(0)
    theirs.close()
    replies = ours.makefile("r")
    assert json.loads(replies.readline()) == {"ready": True}
    ours.sendall(json.dumps({"args": [], "env": dict(os.environ)}).encode() + b"\\n")
    reply = json.loads(replies.readline())
    assert "pid" in reply, reply
    _, status = os.waitpid(reply["pid"], 0)
    assert os.waitstatus_to_exitcode(status) == 0
    replies.close()
    ours.close()
    """
)


@pytest.mark.parametrize("budget", [1, 2])
def test_a_forked_worker_runs_the_openmp_team_of_its_budget(budget: int) -> None:
    """OpenMP sized its teams when torch loaded in the fork server; a thread the forked
    worker starts (its engine thread) runs a team of that size, and its BLAS works. With
    a budget over 1, numpy's OpenBLAS pool is running at the fork: it is forked anyway."""
    done = subprocess.run(
        [sys.executable, "-c", OPENMP_TEAM, str(budget)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    team, torch_sum, numpy_sum = json.loads(done.stdout.strip().splitlines()[-1])
    assert team == budget
    assert torch_sum == 512.0**3
    assert numpy_sum == 64.0**3


ORPHANS = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from omnipipe.local.forks import become_subreaper, reap_orphans

    assert become_subreaper()
    known = subprocess.Popen([sys.executable, "-c", "pass"])
    # A child that starts a grandchild and exits: the grandchild is adopted by us.
    subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True)
    time.sleep(1.0)  # both exited: the grandchild a zombie of ours, the known one too
    reap_orphans({known.pid})
    zombies = [
        int(pid) for pid in os.listdir("/proc") if pid.isdigit()
        and open(f"/proc/{pid}/stat").read().split(") ")[1].split()[:2] == ["Z", str(os.getpid())]
    ]
    print(json.dumps({"zombies": zombies, "known": known.pid, "code": known.wait()}))
    """
)


def test_an_adopted_orphan_is_reaped_and_a_known_childs_exit_code_is_left_to_its_owner() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ORPHANS], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Only the known child is left a zombie, for its owner's wait, which reads its code.
    assert result["zombies"] == [result["known"]]
    assert result["code"] == 0
