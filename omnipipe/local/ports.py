"""Picking a port for a process that will bind it a moment later."""

from __future__ import annotations

import errno
import os
import random
import socket
from collections.abc import Collection
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, for kernels that do not say.
DEFAULT_EPHEMERAL_LOW = 32768
LOWEST_PORT = 10000
MAX_PORT = 65535
# "LOW-HIGH": the ports free_port picks from, in this process and the children that
# inherit it. A port picked is free, not held: until its child binds it (seconds, after
# imports), another process picking from the same ports can pick and bind it first (seen
# with two test sessions' serves side by side: a worker's control port taken by another
# serve's transfer listener). Processes that start serves at once get a range each.
PORT_RANGE_ENV = "OMNIPIPE_PORT_RANGE"


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def check_port_free(host: str, port: int) -> None:
    """Raises OSError naming the port when `host:port` cannot be bound now: held by
    another server (another omnipipe's router answers /ready, and would be taken for
    ours) or not a port at all. Bound as uvicorn binds it (SO_REUSEADDR), so connections
    still closing on the port do not count."""
    if not 1 <= port <= MAX_PORT:
        raise OSError(f"port {port} is not a port: give a number from 1 to {MAX_PORT}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    f"port {port} on {host} is already in use (another omnipipe serve, or "
                    "another server): stop it or pass --port with a free port"
                ) from None
            raise OSError(f"cannot bind {host}:{port}: {exc.strerror}") from None


def _configured_range() -> tuple[int, int] | None:
    given = os.environ.get(PORT_RANGE_ENV, "")
    if not given:
        return None
    low, dash, high = given.partition("-")
    try:
        picked = (int(low), int(high)) if dash else None
    except ValueError:
        picked = None
    if picked is None or not 1 <= picked[0] <= picked[1] <= MAX_PORT:
        raise OSError(f"{PORT_RANGE_ENV}={given!r}: give LOW-HIGH, from 1 to {MAX_PORT}")
    return picked


def port_range() -> tuple[int, int]:
    """The ports free_port picks from, both included: $OMNIPIPE_PORT_RANGE, else those
    below the kernel's ephemeral range."""
    return _configured_range() or (LOWEST_PORT, _ephemeral_low() - 1)


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port nobody holds, taken from port_range(), and none of `avoid`: ports already
    handed to children that have not bound them yet.

    Binding port 0 would hand out an ephemeral port, and the kernel gives the same
    ports to outgoing connections: one of them can take it between our picking it
    and the child binding it (seen in CI as a worker exiting on "address in use").
    Nothing takes a port below the range unless it asks for that port by number.
    """
    configured = _configured_range()
    low, high = configured or port_range()
    if configured or high >= low + 1000:
        for _ in range(200):
            port = random.randrange(low, high + 1)
            if port not in avoid and _bindable(host, port):
                return port
        if configured:
            raise OSError(f"no free port on {host} in {PORT_RANGE_ENV}={low}-{high}")
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            picked: int = s.getsockname()[1]
        if picked not in avoid:
            return picked
    raise OSError(f"no free port on {host}")
