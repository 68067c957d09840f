"""Property-based fuzzing of the public API with schemathesis, generated from /openapi.json.

Whatever a client sends that the document allows (and much that it does not), the service
answers without a server error, with a status the document lists for that operation, and
with a body of the documented shape.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from app.settings import Settings


def _openapi_document() -> dict[str, Any]:
    """Read from an app that never starts (nor touches its database): the document does not
    depend on settings. (schemathesis.pytest.from_fixture would read it from each test's own
    app, but fails on pytest 9.2.)"""
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(home=Path(home), database_url=f"sqlite:///{home}/unused.db")
        document: dict[str, Any] = create_app(settings, start_background=False).openapi()
        return document


# The worker callbacks are not for clients: a per-run token guards them.
schema = schemathesis.openapi.from_dict(_openapi_document()).exclude(path_regex="^/v1/internal/")


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: the contract does not depend on the database, and fuzzing takes time."""
    return f"sqlite:///{tmp_path / 'tuneyard.db'}"


@pytest.fixture
def app(settings: Settings) -> Iterator[FastAPI]:
    yield create_app(settings, start_background=False)
    asgi.shutdown_lifespans()  # schemathesis starts the app's lifespan on its first call


@schema.parametrize()
@hypothesis.settings(
    max_examples=25,
    deadline=None,
    # The same cases on every run, so CI cannot fail by chance; no example database on disk.
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_the_api_answers_as_documented(
    case: schemathesis.Case, app: FastAPI, auth: dict[str, str]
) -> None:
    case.call_and_validate(
        app=app,
        headers=auth,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
