"""The embedded Ray head that `tuneyard serve` starts when no Ray address is configured.

It listens on 127.0.0.1 only, with token authentication on, on free ports (Ray's default
GCS port 6379 is Redis's on these machines). Its address is recorded under
TUNEYARD_HOME, so a restarted service re-attaches to the head it started instead of
starting a second one, and two services with different homes never collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from app.ports import free_ports
from app.settings import Settings
from contract.job_env import path_with_this_environment

log = logging.getLogger("tuneyard")

STARTUP_TIMEOUT_S = 120
START_ATTEMPTS = 3
# Ray's log monitor re-globs its logs folder every 0.1 s while that holds fewer than 1,000
# files (ray/_private/log_monitor.py, `should_update_filenames`), and every run leaves a
# dozen processes' logs there: on 2 cores, the test suite's two heads, some runs old, spent
# 8% of all the CPU on it.
# With no threshold it looks for new files every LOG_NAME_UPDATE_INTERVAL_S (Ray's 0.5 s)
# and still reads each from its start, so no line is lost, one is at most 0.5 s later.
#
# The queue admits a run when the head reports room (app/cluster/usage.py), and Ray's monitor
# writes that report every AUTOSCALER_UPDATE_INTERVAL_S (Ray's 5 s): a run that freed the
# node stayed taken for 2.5 s on average after it ended, and each queued run waited that
# long. Every second costs the monitor a few reads from the GCS (0.5% of a core).
HEAD_ENV_DEFAULTS = {
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "AUTOSCALER_UPDATE_INTERVAL_S": "1",
}
_PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--node-manager-port",
    "--object-manager-port",
)


@dataclass(slots=True)
class LocalRayHead:
    dashboard_url: str
    gcs_address: str
    pid: int
    temp_dir: str

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the head and every process it started (they share its process group).

        On SIGTERM the GCS, raylet and workers exit within a couple of seconds, while the
        `ray start --block` process and one helper linger about 30 s more (measured on Ray
        2.60) holding nothing: past a short grace period the rest is killed."""
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(self.pid, signal.SIGKILL)
        log.info("stopped local Ray head (pid %d)", self.pid)


def configure_ray_auth(settings: Settings) -> Path:
    """Token auth for the embedded head and for this process's Ray clients.

    The token lives under TUNEYARD_HOME, not in ~/.ray, so each tuneyard home has its own.
    """
    token_path = settings.ray_state_dir / "auth_token"
    token_path.parent.mkdir(parents=True, exist_ok=True)
    if not token_path.exists():
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    return token_path


def ensure_local_head(settings: Settings) -> LocalRayHead:
    """Re-attach to this home's running head, or start a new one.

    Several processes may ask at once (the workers of `serve --workers N`, each reviving a
    head that died): a lock on the home's Ray folder lets exactly one of them start it."""
    configure_ray_auth(settings)
    with open(settings.ray_state_dir / "head.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _attach_or_start(settings)


def stop_local_head(settings: Settings) -> None:
    """Stop this home's head, whichever process started it last."""
    state_file = settings.ray_state_dir / "head.json"
    if state_file.exists():
        LocalRayHead(**json.loads(state_file.read_text())).stop()
    forget_local_head(settings)


def _attach_or_start(settings: Settings) -> LocalRayHead:
    state_file = settings.ray_state_dir / "head.json"
    if state_file.exists():
        head = LocalRayHead(**json.loads(state_file.read_text()))
        if _alive(head.pid):
            # Alive but not answering yet is still ours: wait for it, never start a second.
            log.info("re-attached to local Ray head at %s (pid %d)", head.dashboard_url, head.pid)
            return head
        _signal_group(head.pid, signal.SIGKILL)  # whatever of the dead head is left
        state_file.unlink()

    # A port found free may be taken by another process before Ray binds it (two services
    # starting side by side): `ray start` then exits at once, or its dashboard agent comes
    # up without its server (app/ports.py says why that is rare now); fresh ports are tried.
    for attempt in range(1, START_ATTEMPTS + 1):
        head, proc, log_path = _start(settings)
        failure = _wait_until_ready(head, proc, token=_token(settings))
        if failure is None:
            state_file.write_text(json.dumps(asdict(head)))
            log.info("started local Ray head at %s (pid %d)", head.dashboard_url, head.pid)
            return head
        head.stop(timeout_s=5)
        tail = log_path.read_text(errors="replace")[-3000:]
        if failure == "timed out" or attempt == START_ATTEMPTS:
            raise RuntimeError(
                f"the local Ray head did not start ({failure}); its log ends:\n{tail}"
            )
        log.warning(
            "the local Ray head %s (attempt %d); starting it on other ports", failure, attempt
        )
    raise AssertionError("unreachable")


def _start(settings: Settings) -> tuple[LocalRayHead, subprocess.Popen[bytes], Path]:
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
    # A short temp dir of its own per home: Ray's socket paths must stay under 108 bytes.
    digest = hashlib.sha256(str(settings.home_dir).encode()).hexdigest()[:10]
    temp_dir = f"/tmp/tuneyard-ray-{digest}"
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]
    if settings.local_ray_num_cpus:
        cmd.append(f"--num-cpus={settings.local_ray_num_cpus}")
    env = dict(os.environ)
    # Job entrypoints run `python -m worker`: make that this environment's python.
    env["PATH"] = path_with_this_environment(env.get("PATH"))
    for name, value in HEAD_ENV_DEFAULTS.items():
        env.setdefault(name, value)  # an operator's own setting wins
    log_path = settings.ray_state_dir / "head.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    head = LocalRayHead(
        dashboard_url=f"http://127.0.0.1:{ports['--dashboard-port']}",
        gcs_address=f"127.0.0.1:{ports['--port']}",
        pid=proc.pid,
        temp_dir=temp_dir,
    )
    return head, proc, log_path


def _wait_until_ready(
    head: LocalRayHead, proc: subprocess.Popen[bytes], *, token: str
) -> str | None:
    """None once the head is ready, else what went wrong: "exited with N", "timed out" or
    the node's own failure (`_agent_failure`)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while (node := _head_node(head.dashboard_url, token=token)) is None:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        if time.monotonic() > deadline:
            return "timed out"
        time.sleep(0.5)
    return _agent_failure(node)


def _token(settings: Settings) -> str:
    return (settings.ray_state_dir / "auth_token").read_text().strip()


def forget_local_head(settings: Settings) -> None:
    (settings.ray_state_dir / "head.json").unlink(missing_ok=True)


def _head_node(url: str, *, token: str) -> dict[str, Any] | None:
    """The head's own node as the dashboard's node list shows it; None while it is not there.

    The dashboard answers before the raylet has registered with the GCS; a job submitted
    in between waits for its supervisor actor with no node to place it on. Token auth is
    on, so the request carries the head's token as a Bearer header (Ray's
    http_token_authentication)."""
    try:
        response = httpx.get(
            f"{url}/nodes?view=summary",
            headers={"Authorization": f"Bearer {token}"},
            timeout=2.0,
        )
        if response.status_code != 200:
            return None
        nodes = response.json()["data"]["summary"]
        return next((dict(n) for n in nodes if (n.get("raylet") or {}).get("isHeadNode")), None)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _agent_failure(node: dict[str, Any]) -> str | None:
    """Why the node cannot take jobs though it registered, or None.

    A dashboard agent whose server cannot bind its port stays alive with the server off,
    and Ray records the port as -1 (ray/dashboard/agent.py): the node registers and
    answers, but every job submission is refused ("No available agent to submit job") for
    the head's whole life. Started again on fresh ports, it comes up whole. (The runtime env
    agent exits instead, and the node never registers.)"""
    port = (node.get("raylet") or {}).get("dashboardAgentListenPort")
    if isinstance(port, int) and port < 0:
        return "started without its dashboard agent, whose port was taken"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still "exists"; reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        pass
    # Another process's child: `serve --workers N`'s parent starts the head, and a head that
    # died stays its zombie, unreaped, which a worker reviving it must not take for alive.
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (macOS), or it ended meanwhile: judged by the signal alone
        return False
    # The state follows the command name, which is in parentheses and may hold any byte.
    return stat[stat.rfind(")") + 2 :].startswith(("Z", "X"))


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
