"""Fixtures for the service's tests: a run that a (recording) Ray has started."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.ports import free_port
from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import bearer, job_token
from tests.factories import run_request


def start_run(
    client: TestClient,
    auth: dict[str, str],
    root: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> tuple[str, str]:
    """Create a run and dispatch it to a recording Ray: (run id, the worker's token)."""
    run_id = client.post("/v1/runs", json=run_request(root), headers=auth).json()["id"]
    ray = dispatch_to(ScriptedRay(), settings, session_factory)
    return run_id, job_token(ray.submitted[-1])


@pytest.fixture
def started(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> tuple[str, dict[str, str]]:
    """A started run: (its id, the headers its worker posts with)."""
    run_id, token = start_run(client, auth, tmp_path, settings, session_factory)
    return run_id, bearer(token)


@contextmanager
def served(api: Any) -> Iterator[str]:
    """`api` on a loopback port (uvicorn in a thread), for clients that speak real HTTP;
    its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
