"""The real service (`python -m app serve`) with its own local Ray head, for benchmarks.

Like the end-to-end tests' fixture, but standalone: benchmarks are scripts, not tests.
"""

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.ports import free_port
from bench.common import REPO_ROOT

TERMINAL = {"succeeded", "failed", "cancelled"}
# The test suite's server (trust auth); benchmarks make a database of their own on it.
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@dataclass
class BenchService:
    """A running service: its API (`http`, with an API key) and its Ray dashboard."""

    base_url: str
    http: httpx.Client
    api_key: str
    ray_dashboard_url: str
    ray_headers: dict[str, str]
    home: Path
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/v1/runs", json=body)
        if response.status_code != 201:
            raise RuntimeError(f"POST /v1/runs → {response.status_code}: {response.text}")
        run: dict[str, Any] = response.json()
        return run

    def wait_for(
        self, run_id: str, statuses: set[str], *, timeout_s: float = 600, poll_s: float = 0.2
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        run: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                run = self.http.get(f"/v1/runs/{run_id}").json()
                if run["status"] in statuses:
                    return run
            time.sleep(poll_s)
        raise TimeoutError(f"run {run_id} not {statuses} after {timeout_s}s: {run}")

    def wait_terminal(
        self, run_id: str, *, timeout_s: float = 600, poll_s: float = 0.2
    ) -> dict[str, Any]:
        return self.wait_for(run_id, TERMINAL, timeout_s=timeout_s, poll_s=poll_s)

    def ray_processes(self) -> list[Any]:
        """Every process of the local Ray head (they share its process group)."""
        import psutil

        head_pid = int(json.loads((self.home / "ray" / "head.json").read_text())["pid"])
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if os.getpgid(proc.pid) == head_pid:
                    found.append(proc)
        return found

    def ray_job(self, submission_id: str) -> dict[str, Any]:
        """Ray's own view of a job (`GET /api/jobs/{submission_id}` on the dashboard)."""
        response = httpx.get(
            f"{self.ray_dashboard_url}/api/jobs/{submission_id}",
            headers=self.ray_headers,
            timeout=30,
        )
        response.raise_for_status()
        info: dict[str, Any] = response.json()
        return info


def service_env(
    home: Path,
    *,
    port: int,
    allowed_roots: list[Path],
    database_url: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a service on its embedded defaults under `home`."""
    result = {
        **os.environ,
        "TUNEYARD_HOME": str(home),
        "TUNEYARD_PORT": str(port),
        "TUNEYARD_ALLOWED_ROOTS": ":".join(str(r) for r in allowed_roots),
        # No hub is reachable here; offline mode makes a hub id fail at once.
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO_ROOT),
    }
    result.pop("TUNEYARD_DATABASE_URL", None)
    if database_url:
        result["TUNEYARD_DATABASE_URL"] = database_url
    result.update(env or {})
    return result


def create_api_key(env: dict[str, str], name: str = "bench") -> str:
    return subprocess.run(
        [sys.executable, "-m", "app", "keys", "create", "--name", name],
        env=env,
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@contextmanager
def running_service(
    home: Path,
    *,
    allowed_roots: list[Path],
    database_url: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 180,
) -> Iterator[BenchService]:
    """Start `python -m app serve` under `home` with its own local Ray head; wait until
    /healthz says Ray is reachable; stop it with SIGINT (which also stops the head)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full_env = service_env(
        home, port=port, allowed_roots=allowed_roots, database_url=database_url, env=env
    )
    api_key = create_api_key(full_env)
    base_url = f"http://127.0.0.1:{port}"
    log_path = home / "service.log"
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"],
            env=full_env,
            cwd=REPO_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    http = httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    )
    try:
        health = _wait_healthy(http, proc, log_path, startup_timeout_s)
        token = (home / "ray" / "auth_token").read_text().strip()
        yield BenchService(
            base_url=base_url,
            http=http,
            api_key=api_key,
            ray_dashboard_url=str(health["ray"]["dashboard_url"]).rstrip("/"),
            ray_headers={"Authorization": f"Bearer {token}"},
            home=home,
            log_path=log_path,
            proc=proc,
        )
    finally:
        http.close()
        stop_service(proc)


def serve_http_only() -> None:
    """`tuneyard serve` without Ray and without the dispatcher: the HTTP layer and its
    database, configured from the environment as `serve` is. For benchmarks of the API
    alone, whose runs no dispatcher or reconciler should touch."""
    import uvicorn

    from app.logs import configure_logging
    from app.main import create_app
    from app.settings import Settings

    settings = Settings()
    configure_logging(fmt=settings.log_format, level=settings.log_level)
    uvicorn.run(
        create_app(settings, start_background=False),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level.lower(),
    )


@contextmanager
def running_http_only_service(
    home: Path,
    *,
    database_url: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 60,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`serve_http_only` in a process of its own: its base URL and process."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full_env = service_env(
        home, port=port, allowed_roots=[home], database_url=database_url, env=env
    )
    base_url = f"http://127.0.0.1:{port}"
    log_path = home / "service.log"
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from bench.service import serve_http_only as s; s()"],
            env=full_env,
            cwd=REPO_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/healthz", timeout=5).json()["database"] == "ok":
                    break
            time.sleep(0.3)
        yield base_url, proc
    finally:
        stop_service(proc)


def _wait_healthy(
    http: httpx.Client, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the service exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the service did not start:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health: dict[str, Any] = http.get("/healthz").json()
            if health["ray"]["reachable"]:
                return health
        time.sleep(0.5)


def stop_service(proc: subprocess.Popen[bytes], timeout_s: float = 90) -> None:
    """SIGINT is a clean shutdown: the service stops its local Ray head too."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=30)


@dataclass(frozen=True)
class TinyAssets:
    root: Path
    model: Path
    dataset: Path


def build_tiny_assets(root: Path, *, rows: int = 512) -> TinyAssets:
    """A tiny GPT-2 (with its tokenizer) and a jsonl dataset under `root`; reused if built."""
    from app.cli.tiny_assets import build_tiny_gpt2, write_jsonl_dataset

    model = root / "tiny-gpt2"
    dataset = root / "news.jsonl"
    if not (model / "config.json").exists():
        build_tiny_gpt2(model)
    if not dataset.exists():
        write_jsonl_dataset(dataset, rows=rows)
    return TinyAssets(root=root, model=model, dataset=dataset)


def tiny_run_body(assets: TinyAssets, *, max_steps: int = 5, **overrides: Any) -> dict[str, Any]:
    """A small, valid run request on the tiny assets: ZeRO-2 on 2 workers."""
    body: dict[str, Any] = {
        "model": str(assets.model),
        "dataset": {"source": str(assets.dataset), "text_field": "text"},
        "training": {
            "max_steps": max_steps,
            "learning_rate": 3e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2},
        "checkpointing": {"export_hf": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body


def cpu_seconds(processes: list[Any]) -> float:
    """User + system CPU time the processes have used so far (those that ended count 0)."""
    import psutil

    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


@contextmanager
def scratch_postgres(admin_url: str) -> Iterator[str]:
    """A database of its own on the PostgreSQL server at `admin_url`, dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    name = f"tuneyard_bench_{secrets.token_hex(4)}"
    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
