"""`python -m omnipipe.fork_server --socket-fd N`: what `omnipipe serve` forks its workers
from (omnipipe/local/forks.py). It imports what every worker imports, with the thread
budget serve gives it in the environment, and never runs torch code itself: a fork after
a parallel region would leave the worker an OpenMP pool whose threads did not fork."""

from __future__ import annotations

import argparse
import os
import socket
import sys


def preload() -> None:
    """What a worker imports before it loads a stage (4.8 CPU-seconds of its 6.2)."""
    import diffusers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import omnipipe.worker.main  # noqa: F401
    from omnipipe.api.families import load_installed

    load_installed()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket-fd", type=int, required=True)
    args = parser.parse_args()
    threads = os.environ["OMNIPIPE_FORK_SERVER_THREADS"]
    # Before torch loads: OpenMP reads them once (worker/threads.py).
    from omnipipe.worker.threads import budget_environment

    os.environ.update(budget_environment(int(threads)))
    preload()
    from omnipipe.local.forks import serve_requests

    job = serve_requests(socket.socket(fileno=args.socket_fd))
    # In a forked worker from here on, as `omnipipe ARGS` would run.
    from omnipipe.cli import main as cli_main

    return cli_main(job.args)


if __name__ == "__main__":
    sys.exit(main())
