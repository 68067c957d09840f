"""app/ports.py: local ports picked below the kernel's ephemeral range, free on every
interface, distinct."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from app import ports
from app.ports import LOWEST_PORT, ephemeral_start, free_ports


def test_ports_are_distinct_and_below_the_ephemeral_range() -> None:
    picked = free_ports(7)
    assert len(set(picked)) == 7
    top = ephemeral_start()
    if top - LOWEST_PORT >= ports.MIN_SPAN:  # this machine has room below its range
        assert all(LOWEST_PORT <= port < top for port in picked), (picked, top)
    for port in picked:  # each is free on every interface now
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_taken_on_any_interface_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind((socket.gethostbyname(socket.gethostname()), 0))
        held = taken.getsockname()[1]
        tries = iter([held, held])
        pick = ports._RANDOM.randrange
        # The held port comes up first twice, as a random pick might; then any.
        monkeypatch.setattr(
            ports._RANDOM, "randrange", lambda low, high: next(tries, None) or pick(low, high)
        )
        monkeypatch.setattr(ports, "LOWEST_PORT", min(held, 60000))
        (port,) = free_ports(1)
        assert port != held


def test_without_room_below_the_range_ports_come_from_above_rays_worker_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")  # an ephemeral range that starts low
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    assert ephemeral_start() == 1024
    picked = free_ports(20)
    assert len(set(picked)) == 20 and all(LOWEST_PORT <= port <= 65535 for port in picked)
    # Where there is no such file (macOS), IANA's dynamic range stands for it.
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    assert ephemeral_start() == ports.IANA_EPHEMERAL_START
