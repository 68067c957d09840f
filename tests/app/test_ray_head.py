"""Whether the embedded Ray head is alive, as a process reviving it judges."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cluster import ray_head
from app.cluster.ray_head import (
    _PORT_FLAGS,
    _alive,
    _node_registered,
    ensure_local_head,
    stop_local_head,
)
from app.ports import free_ports
from app.settings import Settings

# Stands for `serve --workers N`'s parent: it starts a child (the head) that ends and is never
# reaped, so it stays a zombie of a process that is not the one asking.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "pass"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads procfs")
def test_a_head_dead_as_another_processs_zombie_is_not_alive() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        head = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while "Z" not in Path(f"/proc/{head}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline, "the child never ended"
            time.sleep(0.1)
        assert not _alive(head)
        assert _alive(parent.pid)
    finally:
        parent.kill()
        parent.wait()


def test_a_head_that_is_our_own_ended_child_is_reaped_and_not_alive() -> None:
    head = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while _alive(head.pid):
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.1)


def test_a_head_whose_port_was_taken_starts_on_other_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ray start` exits when a port found free was taken meanwhile (another service
    starting beside this one); the service starts the head again on fresh ports, and calls
    it started only once its node is registered, not once the dashboard answers."""
    # configure_ray_auth sets these for the process: undone after the test.
    monkeypatch.setenv("RAY_AUTH_MODE", "")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "")
    settings = Settings(home=tmp_path, local_ray_num_cpus=1)
    picked: list[list[int]] = []

    def ports(count: int) -> list[int]:
        chosen = list(free_ports(count))
        if not picked:
            # The dashboard's port, held below: Ray exits within seconds (a GCS port taken
            # costs it 40 s of retries first).
            chosen[_PORT_FLAGS.index("--dashboard-port")] = taken.getsockname()[1]
        picked.append(chosen)
        return chosen

    monkeypatch.setattr(ray_head, "free_ports", ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        head = ensure_local_head(settings)
        try:
            assert len(picked) == 2
            dashboard_port = picked[1][_PORT_FLAGS.index("--dashboard-port")]
            assert head.dashboard_url == f"http://127.0.0.1:{dashboard_port}"
            token = (settings.ray_state_dir / "auth_token").read_text()
            assert _node_registered(head.dashboard_url, token=token)
            # Without the token the dashboard refuses: readiness is not "it answered".
            assert not _node_registered(head.dashboard_url, token="not-the-token")
        finally:
            stop_local_head(settings)
