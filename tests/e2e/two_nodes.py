"""A two-node Ray cluster on this machine, as `ray start` builds one on two hosts: a head,
and a second node joined with `ray start --address`, each with its own CPUs, ports and
temp dir, token authentication on. Tests kill the second node's raylet by its PID (a
node lost) and start a new second node."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from app.ports import free_ports
from contract.job_env import path_with_this_environment

# Every port a node opens, given free ones: Ray's defaults would collide with the shared
# e2e service's own head on this machine.
_NODE_PORT_FLAGS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)
_HEAD_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port")
# A stopped node's processes exit within seconds; `ray start --block` itself lingers about
# 30 s more holding nothing (as app/cluster/ray_head.py's stop says), and is killed past this.
_STOP_GRACE_S = 5.0
# How long a node may take to count as alive: tens of seconds on a 2-core machine that the
# rest of the suite keeps busy.
_JOIN_TIMEOUT_S = 180.0
# Attempts at starting a node: a port picked free may be taken before `ray start` binds it.
_START_ATTEMPTS = 2
_LOG_LINES = 40


@dataclass
class RayNode:
    proc: subprocess.Popen[bytes]
    temp_dir: str
    node_manager_port: int
    log: Path

    def exited(self) -> bool:
        """`ray start --block` ended: the node failed to start (a port taken since it was
        picked, say) or was stopped."""
        return self.proc.poll() is not None

    def log_tail(self) -> str:
        """The end of what `ray start` printed and of this node's raylet log."""
        parts = [self.log]
        parts += sorted(Path(self.temp_dir).glob("session_latest/logs/raylet.*"))
        tails = []
        for path in parts:
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-_LOG_LINES:]
                tails.append(f"--- {path}\n" + "\n".join(lines))
        return "\n".join(tails)

    def node_id(self, cluster: TwoNodeCluster) -> str | None:
        """This node's id while the cluster counts it alive, else None."""
        return cluster.alive_nodes().get(self.node_manager_port)

    def raylet_pid(self) -> int:
        """The raylet of this node: the process Ray runs with this node's manager port."""
        flag = f"--node_manager_port={self.node_manager_port}"
        for proc in psutil.process_iter(["name", "cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if "raylet" in (proc.info["name"] or "") and flag in cmdline:
                return int(proc.pid)
        raise AssertionError(f"no raylet with {flag}")

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait for a terminated node until `deadline`, then kill what is left of it."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass
class TwoNodeCluster:
    root: Path
    token_path: Path
    gcs_address: str = ""
    dashboard_url: str = ""
    head: RayNode | None = None
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a Ray client of this cluster (the service) needs."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def start(self) -> None:
        ports = free_ports(len(_HEAD_PORT_FLAGS))
        head_ports = dict(zip(_HEAD_PORT_FLAGS, ports, strict=True))
        self.gcs_address = f"127.0.0.1:{head_ports['--port']}"
        self.dashboard_url = f"http://127.0.0.1:{head_ports['--dashboard-port']}"
        self.head = self._start_node(
            "head",
            ["--head", "--include-dashboard=true", "--dashboard-host=127.0.0.1"]
            + [f"{flag}={port}" for flag, port in head_ports.items()],
        )
        self._wait_alive(self.head, "the head to be up")
        self.add_node()

    def add_node(self) -> RayNode:
        """A second node, joined to the head; returns once the cluster counts it alive. A
        node whose `ray start` failed is started again on other ports."""
        name = f"node{len(self.nodes) + 1}"
        for attempt in range(1, _START_ATTEMPTS + 1):
            node = self._start_node(f"{name}-{attempt}", [f"--address={self.gcs_address}"])
            self.nodes.append(node)
            if self._wait_alive(node, "the second node to join", last=attempt == _START_ATTEMPTS):
                return node
        raise AssertionError("unreachable")

    def _wait_alive(self, node: RayNode, what: str, *, last: bool = True) -> bool:
        """Whether `node` came up; a node that exited is False unless it was the `last`
        try, and one that never came up fails, each with the node's logs."""
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        while node.node_id(self) is None:
            if node.exited():
                assert not last, f"{what}: `ray start` exited\n{node.log_tail()}"
                return False
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{node.log_tail()}"
            time.sleep(0.5)
        return True

    def head_node_id(self) -> str:
        assert self.head is not None
        node_id = self.head.node_id(self)
        assert node_id is not None, "the head is not alive"
        return node_id

    def alive_nodes(self) -> dict[int, str]:
        """Alive nodes' manager ports → their node ids."""
        try:
            nodes = httpx.get(
                f"{self.dashboard_url}/nodes?view=summary",
                headers={"Authorization": f"Bearer {self.token_path.read_text().strip()}"},
                timeout=5,
            ).json()["data"]["summary"]
        except (httpx.HTTPError, ValueError, KeyError):
            return {}
        return {
            n["raylet"]["nodeManagerPort"]: n["raylet"]["nodeId"]
            for n in nodes
            if n["raylet"].get("state") == "ALIVE"
        }

    def stop(self) -> None:
        """Every node at once: each one's grace period is spent waiting, so the nodes share
        one rather than taking theirs in turn."""
        nodes = [*self.nodes, *([self.head] if self.head else [])]
        for node in nodes:
            node.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for node in nodes:
            node.finish(deadline)

    def _start_node(self, name: str, args: list[str]) -> RayNode:
        ports = dict(zip(_NODE_PORT_FLAGS, free_ports(len(_NODE_PORT_FLAGS)), strict=True))
        # Short: Ray's socket paths under it must stay within 108 bytes.
        digest = hashlib.sha256(f"{self.root}{name}".encode()).hexdigest()[:8]
        temp_dir = f"/tmp/ty2n-{digest}"
        env = {
            **os.environ,
            **self.env,
            "PATH": path_with_this_environment(os.environ.get("PATH")),
        }
        log_path = self.root / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the node outlives this call
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("ray")),
                "start",
                "--block",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=1",
                "--disable-usage-stats",
                f"--temp-dir={temp_dir}",
                *args,
                *(f"{flag}={port}" for flag, port in ports.items()),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        return RayNode(proc, temp_dir, ports["--node-manager-port"], log_path)


def start_two_node_cluster(root: Path) -> TwoNodeCluster:
    root.mkdir(parents=True, exist_ok=True)
    token_path = root / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    cluster = TwoNodeCluster(root, token_path)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster
