"""Whether the embedded Ray head is alive, as a process reviving it judges."""

from __future__ import annotations

import contextlib
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
    _head_node,
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


def test_a_head_whose_ports_were_taken_starts_on_other_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A port found free may be taken before Ray binds it (another service starting beside
    this one). Its dashboard's port taken, `ray start` exits; its dashboard agent's port
    taken, the head comes up and answers but refuses every job. Either way the service
    starts the head again on fresh ports, and calls it started only once its node is
    registered with its agent serving, not once the dashboard answers."""
    # configure_ray_auth sets these for the process: undone after the test.
    monkeypatch.setenv("RAY_AUTH_MODE", "")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "")
    settings = Settings(home=tmp_path, local_ray_num_cpus=1)
    # First the dashboard's port (Ray exits within seconds; a GCS port taken costs it 40 s
    # of retries first), then the agent's (its server gives up after six tries).
    taken_flags = ["--dashboard-port", "--dashboard-agent-listen-port"]
    picked: list[list[int]] = []

    def ports(count: int) -> list[int]:
        chosen = list(free_ports(count))
        if len(picked) < len(taken_flags):
            flag = taken_flags[len(picked)]
            chosen[_PORT_FLAGS.index(flag)] = held[flag].getsockname()[1]
        picked.append(chosen)
        return chosen

    monkeypatch.setattr(ray_head, "free_ports", ports)
    with contextlib.ExitStack() as stack:
        held = {flag: stack.enter_context(socket.socket()) for flag in taken_flags}
        for sock in held.values():
            sock.bind(("", 0))  # every interface: the agent binds the node's address
            sock.listen()
        head = ensure_local_head(settings)
        try:
            assert len(picked) == 3
            assert "exited with 1 (attempt 1)" in caplog.text
            assert "started without its dashboard agent, whose port was taken (attempt 2)" in (
                caplog.text
            )
            dashboard_port = picked[2][_PORT_FLAGS.index("--dashboard-port")]
            assert head.dashboard_url == f"http://127.0.0.1:{dashboard_port}"
            token = (settings.ray_state_dir / "auth_token").read_text()
            node = _head_node(head.dashboard_url, token=token)
            assert node is not None
            agent_port = picked[2][_PORT_FLAGS.index("--dashboard-agent-listen-port")]
            assert node["raylet"]["dashboardAgentListenPort"] == agent_port, node["raylet"]
            # Without the token the dashboard refuses: readiness is not "it answered".
            assert _head_node(head.dashboard_url, token="not-the-token") is None
            # Its monitor reports what is free every second: the queue's view of room.
            assert _monitor_env(head.pid).get("AUTOSCALER_UPDATE_INTERVAL_S") == "1"
        finally:
            stop_local_head(settings)


def _monitor_env(head_pid: int, timeout_s: float = 30) -> dict[str, str]:
    """The environment of the head's autoscaler monitor (`ray start` starts it beside the
    GCS, maybe a moment after the node registered)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        for child in psutil.Process(head_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any(arg.endswith("autoscaler/_private/monitor.py") for arg in child.cmdline()):
                    return dict(child.environ())
        assert time.monotonic() < deadline, "the head started no autoscaler monitor"
        time.sleep(0.5)
