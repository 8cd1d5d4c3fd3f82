"""NIXL's DRAM-to-DRAM WRITE between two processes, in a hand-off's shape: `size` random
bytes written into the receiver's registered buffer with a notification, and a
notification back as the ack. Agent metadata and the buffer's address travel over the
child's stdin/stdout; the transfer request is made once and posted again each round.

NIXL is not a dependency: bench/transfer.py runs this only when `nixl_cu12` imports
(`pip install --no-deps --target DIR nixl-cu12`, then PYTHONPATH=DIR)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import numpy as np

PROGRESS_THREAD = False


def available() -> bool:
    try:
        import nixl_cu12  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def _agent(name: str, size: int, fill: bool) -> tuple[Any, Any]:
    from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

    # No progress thread: like raw ucxx, the waiting side polls (a thread would take the
    # second core that the peer needs on this 2-core VM).
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=PROGRESS_THREAD))
    buf = (
        np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        if fill
        else np.empty(size, dtype=np.uint8)
    )
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    return agent, buf


def _read(stream: Any) -> str:
    # UCX's warnings and NIXL's log lines go to stdout too.
    line: str = stream.readline()
    while line and not line.startswith("agent "):
        line = stream.readline()
    return line.removeprefix("agent ").strip()


def _name(agent: bytes | str) -> str:
    # add_remote_agent answers bytes; notifications are keyed by str.
    return agent.decode() if isinstance(agent, bytes) else agent


def serve(size: int) -> None:
    """Receiver: answers each write's notification with one of its own."""
    agent, buf = _agent("rx", size, fill=False)
    print("agent", agent.get_agent_metadata().hex(), buf.ctypes.data, flush=True)
    sender = _name(agent.add_remote_agent(bytes.fromhex(sys.stdin.readline().strip())))
    while True:
        for _ in agent.get_new_notifs().get(sender, []):
            agent.send_notif(sender, b"ack")


def run(script: str, size: int, n: int, env: dict[str, str]) -> list[float]:
    proc = subprocess.Popen(
        [sys.executable, script, "--serve", f"nixl:{size}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdin is not None
        assert proc.stdout is not None
        agent, buf = _agent("tx", size, fill=True)
        meta, address = _read(proc.stdout).split()
        receiver = _name(agent.add_remote_agent(bytes.fromhex(meta)))
        proc.stdin.write(agent.get_agent_metadata().hex() + "\n")
        proc.stdin.flush()
        local = agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(int(address), size, 0)], "DRAM")
        while agent.check_remote_metadata(receiver) is False:
            time.sleep(0.01)
        handle = agent.initialize_xfer("WRITE", local, remote, receiver, b"w")
        times = []
        for _ in range(n + 3):
            started = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer: {state}")
            while not agent.get_new_notifs().get(receiver):
                pass
            times.append(time.perf_counter() - started)
        return times[3:]
    finally:
        proc.kill()
        proc.wait(timeout=30)
