"""The real service (`python -m app serve`) with its own local Ray head, shared by e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Service:
    base_url: str
    home: Path
    data_dir: Path
    http: httpx.Client
    log_path: Path

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/v1/runs", json=body)
        assert response.status_code == 201, response.text
        run: dict[str, Any] = response.json()
        return run

    def wait_terminal(self, run_id: str, timeout_s: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run: dict[str, Any] = self.http.get(f"/v1/runs/{run_id}").json()
            if run["status"] in TERMINAL:
                return run
            time.sleep(1)
        raise AssertionError(f"run {run_id} not finished after {timeout_s}s: {run}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models_root: Path) -> Iterator[Service]:
    home = tmp_path_factory.mktemp("tuneyard-home")
    data_dir = tmp_path_factory.mktemp("datasets")
    port = _free_port()
    env = {
        **os.environ,
        "TUNEYARD_HOME": str(home),
        "TUNEYARD_PORT": str(port),
        "TUNEYARD_ALLOWED_ROOTS": f"{tiny_models_root}:{data_dir}",
        "TUNEYARD_DISPATCH_INTERVAL_S": "0.5",
        # No hub is reachable here; offline mode makes a hub id fail at once, not after retries.
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("TUNEYARD_DATABASE_URL", None)
    key = subprocess.run(
        [sys.executable, "-m", "app", "keys", "create", "--name", "e2e"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    log_path = home / "service.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if http.get("/healthz").json()["ray"]["reachable"]:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        yield Service(
            base_url=f"http://127.0.0.1:{port}",
            home=home,
            data_dir=data_dir,
            http=http,
            log_path=log_path,
        )
    finally:
        http.close()
        proc.send_signal(signal.SIGINT)  # a clean shutdown also stops the local Ray head
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
