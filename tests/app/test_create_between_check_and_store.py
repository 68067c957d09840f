"""A create checks its request on a read, outside the write lock, and stores the run in a
write after it (app/services/runs.py prepare_run, store_run). What may change in between
is checked again when the run is stored. Real app, real database (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.errors import Unauthorized, ValidationFailed
from app.services import runs as runs_service
from app.services.api_keys import find_api_key, revoke_api_key
from app.services.runs import NewRun
from app.settings import Settings
from contract.run_request import RunRequest
from tests.factories import run_request


def _prepared(
    session_factory: sessionmaker[Session], auth: dict[str, str], body: dict, settings: Settings
) -> tuple[NewRun, str]:
    """The request checked, as the route's read does: (what to store, the key's id)."""
    with session_factory() as session:
        owner = find_api_key(session, secret=auth["Authorization"].removeprefix("Bearer "))
        assert owner is not None
        new = runs_service.prepare_run(
            session,
            request=RunRequest.model_validate(body),
            owner_id=owner.id,
            policy=settings.request_policy(),
        )
    return new, owner.id


def test_a_file_deleted_after_the_checks_is_refused_when_the_run_is_stored(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> None:
    """A delete in between finds no run reading the file: the run must not then be stored
    reading a file that is gone."""
    rows = "".join(json.dumps({"text": f"a b {i}"}) + "\n" for i in range(4)).encode()
    upload = client.post("/v1/files", files={"file": ("d.jsonl", rows)}, headers=auth).json()
    body = run_request(tmp_path, dataset={"source": upload["id"], "text_field": "text"})
    new, _ = _prepared(session_factory, auth, body, settings)
    assert client.delete(f"/v1/files/{upload['id']}", headers=auth).status_code == 200
    with session_factory() as session, pytest.raises(ValidationFailed) as refused:
        runs_service.store_run(session, new)
    assert refused.value.detail == [
        {"field": "dataset.source", "message": f"no uploaded file {upload['id']!r}"}
    ]
    assert client.get("/v1/runs", headers=auth).json()["data"] == []


def test_a_key_revoked_after_the_checks_stores_nothing(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> None:
    new, key_id = _prepared(session_factory, auth, run_request(tmp_path), settings)
    with session_factory() as session:
        revoke_api_key(session, ref=key_id)
        session.commit()
    with session_factory() as session, pytest.raises(Unauthorized):
        runs_service.store_run(session, new)
    with session_factory() as session:
        assert runs_service.list_runs(
            session, owner_id=key_id, status=None, metadata={}, limit=10, cursor=None
        ) == ([], None)
