"""Free TCP ports for the services tuneyard starts locally (the embedded Ray head's seven, the
demo's service, test and benchmark services).

A port is picked now and bound later by another process, so another may take it in between.
The kernel's own pick (bind to port 0) comes from its ephemeral range, the same range every
outgoing connection's local port comes from, and a Ray head makes dozens of connections as it
starts: one of them once took the port picked for the head's dashboard agent, whose server
then stayed down and refused every job ("No available agent to submit job"). So ports are
picked below that range, where only a process binding that very port can take it, and each
is checked free on every interface (Ray's agents bind the node's address, not loopback).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Linux's ephemeral range (net.ipv4.ip_local_port_range); elsewhere IANA's dynamic range.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_START = 49152
# Above Ray's worker ports (10002-19999 by default: `ray start --min-worker-port`), which
# `ray start` refuses to see another of its ports among. With fewer than MIN_SPAN ports
# between this and the ephemeral range, the kernel's pick is used instead.
LOWEST_PORT = 20000
MIN_SPAN = 1000
TRIES_PER_PORT = 50


def ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return IANA_EPHEMERAL_START


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now on every interface. All are held open until all are
    picked, so none repeats; a process binding one of them itself may still take it before
    the caller does (callers that start servers retry on fresh ports)."""
    top = ephemeral_start()
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sockets.append(_bound(top))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bound(top: int) -> socket.socket:
    """A socket bound to a free port below `top` on all interfaces (the kernel's pick if
    there is no room below it)."""
    candidates = range(LOWEST_PORT, top) if top - LOWEST_PORT >= MIN_SPAN else range(0)
    for _ in range(TRIES_PER_PORT if candidates else 0):
        s = socket.socket()
        try:
            s.bind(("", random.choice(candidates)))
        except OSError:
            s.close()
            continue
        return s
    s = socket.socket()
    s.bind(("", 0))
    return s


def free_port() -> int:
    return free_ports(1)[0]
