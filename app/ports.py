"""Free TCP ports on the loopback interface, for the services tuneyard starts locally."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now. All are held open until all are picked, so none repeats;
    another process may still take one before the caller binds it."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
