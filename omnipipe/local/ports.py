"""Picking a port for a process that will bind it a moment later."""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Collection
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, for kernels that do not say.
DEFAULT_EPHEMERAL_LOW = 32768
LOWEST_PORT = 10000
MAX_PORT = 65535


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


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port nobody holds, taken from below the kernel's ephemeral range, and none of
    `avoid`: ports already handed to children that have not bound them yet.

    Binding port 0 would hand out an ephemeral port, and the kernel gives the same
    ports to outgoing connections: one of them can take it between our picking it
    and the child binding it (seen in CI as a worker exiting on "address in use").
    Nothing takes a port below the range unless it asks for that port by number.
    """
    low = _ephemeral_low()
    if low > LOWEST_PORT + 1000:
        for _ in range(200):
            port = random.randrange(LOWEST_PORT, low)
            if port not in avoid and _bindable(host, port):
                return port
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            picked: int = s.getsockname()[1]
        if picked not in avoid:
            return picked
    raise OSError(f"no free port on {host}")
