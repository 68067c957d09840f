"""The real service (`python -m app serve`) with its own local Ray head, shared by e2e tests."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli.commands import WEBHOOK_SECRET_LABEL
from app.ports import free_port
from worker.training.step_gate import STEP_GATE_ENV

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Service:
    """A real `python -m app serve` process; tests may kill and restart it."""

    base_url: str
    home: Path
    data_dir: Path
    http: httpx.Client
    log_path: Path
    env: dict[str, str]
    api_key: str
    # Signs the webhooks of this key's runs (`keys create` shows it on stderr).
    webhook_secret: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 180) -> None:
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "serve"],
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            try:
                if self.http.get("/healthz").json()["ray"]["reachable"]:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)

    @contextlib.contextmanager
    def running(self) -> Iterator[Service]:
        """Started for the block, stopped cleanly after it."""
        self.start()
        try:
            yield self
        finally:
            self.http.close()
            self.stop()

    def kill(self) -> None:
        """kill -9: no shutdown code runs, as in a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # a clean shutdown also stops the local Ray head
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def cli(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        """The `tuneyard` CLI pointed at this service, as a user runs it."""
        env = {
            **self.env,
            "TUNEYARD_URL": self.base_url,
            "TUNEYARD_API_KEY": self.api_key,
            "COLUMNS": "200",
        }
        return subprocess.run(
            [sys.executable, "-m", "app", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/v1/runs", json=body)
        assert response.status_code == 201, response.text
        run: dict[str, Any] = response.json()
        return run

    def hold_at(self, run_id: str, step: int) -> Path:
        """Ask the run's workers to hold after `step` (worker/training/step_gate.py); the file that
        appears when they do."""
        folder = Path(self.env[STEP_GATE_ENV])
        (folder / f"{run_id}.hold").write_text(str(step))
        return folder / f"{run_id}.held"

    def let_go(self, run_id: str) -> None:
        """The run's held workers (`hold_at`) train on."""
        (Path(self.env[STEP_GATE_ENV]) / f"{run_id}.hold").unlink(missing_ok=True)

    def wait_held(
        self, held: Path, run_id: str, *, checkpoint: int | None = None, timeout_s: float = 600
    ) -> None:
        """Until the run holds (`hold_at`) and, with `checkpoint`, the service has recorded
        its checkpoint at that step; a run that ends first fails the test.

        The record is what says Ray Train knows the checkpoint: its controller registers a
        report with its checkpoint manager before it calls the callback that posts the
        record (ray/train/v2/_internal/execution/controller/controller.py, the report
        callbacks' order). A worker killed before that restarts from nothing."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.http.get(f"/v1/runs/{run_id}").json()
            assert run["status"] not in TERMINAL, f"run {run_id} ended before it held: {run}"
            recorded = checkpoint is None or any(
                c["kind"] == "deepspeed" and c["step"] == checkpoint
                for c in self.http.get(f"/v1/runs/{run_id}/checkpoints").json()["data"]
            )
            if held.exists() and recorded:
                return
            assert time.monotonic() < deadline, f"run {run_id} did not hold in {timeout_s}s"
            time.sleep(0.2)

    def wait_terminal(self, run_id: str, timeout_s: float = 600) -> dict[str, Any]:
        return self.wait_for(run_id, TERMINAL, timeout_s)

    def wait_for(self, run_id: str, statuses: set[str], timeout_s: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        run: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                run = self.http.get(f"/v1/runs/{run_id}").json()
                if run["status"] in statuses:
                    return run
            time.sleep(1)  # runs take minutes here; a poll costs the service a read
        log = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
        raise AssertionError(
            f"run {run_id} not {statuses} after {timeout_s}s: {run}\nservice log:\n{log}"
        )


def step_gate_folder(home: Path) -> Path:
    folder = home / "step-gate"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def make_service(
    home: Path, data_dir: Path, allowed_roots: list[Path], *, database_url: str | None = None
) -> Service:
    """A service on its embedded defaults under `home` (or on `database_url`), with an API
    key; not yet started."""
    port = free_port()
    env = {
        **os.environ,
        "TUNEYARD_HOME": str(home),
        "TUNEYARD_PORT": str(port),
        "TUNEYARD_ALLOWED_ROOTS": ":".join(str(r) for r in [*allowed_roots, data_dir]),
        # Runs may ask for webhooks (signed with their key's secret, service-wide
        # subscribers' with this); retries fall due within a test.
        "TUNEYARD_WEBHOOK_SECRET": secrets.token_hex(16),
        "TUNEYARD_WEBHOOK_RETRY_BASE_S": "0.5",
        # The tests' receivers listen on loopback, which only an operator can allow.
        "TUNEYARD_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
        # Runs may ask for tracking: MLflow's SQLite store needs no server (tests/worker/
        # test_tracking.py tests against a real one), W&B offline writes under WANDB_DIR.
        "TUNEYARD_MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "TUNEYARD_JOB_ENV": json.dumps(
            {
                "WANDB_DIR": str(home / "wandb"),
                # Ray Train's controller sees its workers finish (or fail) at its next poll,
                # every 2 s by default; every run here ends that much sooner at 0.5 s.
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                # Ray Train's watch for nodes a cloud is about to take back (spot instances)
                # is an actor per attempt, a process whose imports cost ~2 CPU seconds at
                # every run's start; no node here is ever taken back.
                "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
            }
        ),
        # No hub is reachable here; offline mode makes a hub id fail at once, not after retries.
        "HF_HUB_OFFLINE": "1",
        # Where a test asks a run to hold at a step (worker/training/step_gate.py); Ray's workers
        # inherit it from the local head this service starts.
        STEP_GATE_ENV: str(step_gate_folder(home)),
    }
    env.pop("TUNEYARD_DATABASE_URL", None)
    if database_url:
        env["TUNEYARD_DATABASE_URL"] = database_url
    created = subprocess.run(
        [sys.executable, "-m", "app", "keys", "create", "--name", "e2e"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    key = created.stdout.strip()
    [shown] = [line for line in created.stderr.splitlines() if WEBHOOK_SECRET_LABEL in line]
    webhook_secret = shown.split(WEBHOOK_SECRET_LABEL, 1)[1].strip()
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    return Service(
        base_url=f"http://127.0.0.1:{port}",
        home=home,
        data_dir=data_dir,
        http=http,
        log_path=home / "service.log",
        env=env,
        api_key=key,
        webhook_secret=webhook_secret,
    )


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models_root: Path) -> Iterator[Service]:
    svc = make_service(
        tmp_path_factory.mktemp("tuneyard-home"),
        tmp_path_factory.mktemp("datasets"),
        [tiny_models_root],
    )
    with svc.running():
        yield svc
