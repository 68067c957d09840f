"""Free TCP ports for the services tuneyard starts locally (the embedded Ray head's seven, the
demo's service, test and benchmark services).

A port is picked now and bound later by another process, so another may take it in between.
The kernel's own pick (bind to port 0) comes from its ephemeral range, the same range every
outgoing connection's local port comes from, and a Ray head makes dozens of connections as it
starts: one of them once took the port picked for the head's dashboard agent, whose server
then stayed down and refused every job ("No available agent to submit job"). So ports are
picked below that range, where only a process binding that very port can take it (and
above Ray's worker ports, which `ray start` keeps for itself), and each is checked free on
every interface (Ray's agents bind the node's address, not loopback).
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
# between this and the ephemeral range (a range that starts low), ports come from anywhere
# above it, the ephemeral range included.
LOWEST_PORT = 20000
HIGHEST_PORT = 65535
MIN_SPAN = 1000
TRIES_PER_PORT = 50
# The OS's randomness: a process that seeded `random` (transformers' set_seed) would
# otherwise pick the same ports every time.
_RANDOM = random.SystemRandom()


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
    high = top if top - LOWEST_PORT >= MIN_SPAN else HIGHEST_PORT + 1
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sockets.append(_bound(high))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bound(high: int) -> socket.socket:
    """A socket bound on all interfaces to a free port from LOWEST_PORT up to `high`
    (excluded); the kernel's pick if none is found."""
    for _ in range(TRIES_PER_PORT):
        s = socket.socket()
        try:
            s.bind(("", _RANDOM.randrange(LOWEST_PORT, high)))
        except OSError:
            s.close()
            continue
        return s
    s = socket.socket()
    s.bind(("", 0))
    return s


def free_port() -> int:
    return free_ports(1)[0]
