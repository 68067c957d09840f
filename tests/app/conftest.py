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


# Seconds a test's own HTTP call to a `served` app may take: httpx's default (5 s) is too
# short for a loaded 2-core machine, where the suite's processes and its Ray clusters share
# the cores with the app's thread (a CI run timed out at 5 s).
HTTP_TIMEOUT_S = 60


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


@pytest.fixture
def openai_live(
    settings: Settings, session_factory: sessionmaker[Session]
) -> Iterator[tuple[str, str]]:
    """The HTTP layer served on loopback, for OpenAI's SDK: (its URL, an API key)."""
    from app.main import create_app
    from tests.conftest import make_api_key

    with served(create_app(settings, start_background=False)) as url:
        yield url, make_api_key(session_factory)


@pytest.fixture
def openai_sdk(openai_live: tuple[str, str]) -> Iterator[Any]:
    """OpenAI's own SDK on `openai_live`."""
    import openai

    url, key = openai_live
    with openai.OpenAI(
        base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=HTTP_TIMEOUT_S
    ) as sdk:
        yield sdk
