"""OWASP API1 Broken Object Level Authorization: an uploaded file is one principal's object.
It is reachable only through its file id, by its owner; never by its path under the
service's storage, which the default allowed roots ($TUNEYARD_HOME) contain, so that
tenant B could train on tenant A's upload by naming storage/files/file_xxx.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.storage.models import Run
from tests.conftest import make_api_key
from tests.factories import run_request

ROWS = "".join(json.dumps({"text": f"tenant a secret {i}"}) + "\n" for i in range(8)).encode()


def _upload(client: TestClient, auth: dict[str, str]) -> dict[str, Any]:
    response = client.post("/v1/files", files={"file": ("a.jsonl", ROWS)}, headers=auth)
    assert response.status_code == 201, response.text
    upload: dict[str, Any] = response.json()
    return upload


def _source_problem(client: TestClient, auth: dict[str, str], root: Path, source: str) -> str:
    body = run_request(root, dataset={"source": source, "text_field": "text"})
    response = client.post("/v1/runs", json=body, headers=auth)
    assert response.status_code == 422, response.text
    problems = {p["field"]: p["message"] for p in response.json()["detail"]}
    return problems["dataset.source"]


@pytest.fixture
def tenant_b(session_factory: sessionmaker[Session]) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}


def _stored_path(settings: Settings, upload: dict[str, Any]) -> Path:
    (path,) = (settings.uploads_dir).glob(f"{upload['id']}*")
    return path


class TestUploadedFilesAreTheirOwnersOnly:
    def test_the_owner_trains_on_its_file_by_id(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        upload = _upload(client, auth)
        body = run_request(tmp_path, dataset={"source": upload["id"], "text_field": "text"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 201, response.text

    def test_another_tenant_cannot_use_the_file_id(
        self, client: TestClient, auth: dict[str, str], tenant_b: dict[str, str], tmp_path: Path
    ) -> None:
        upload = _upload(client, auth)
        message = _source_problem(client, tenant_b, tmp_path, upload["id"])
        assert message == f"no uploaded file {upload['id']!r}"

    def test_another_tenant_cannot_use_the_files_path(
        self,
        client: TestClient,
        auth: dict[str, str],
        tenant_b: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        upload = _upload(client, auth)
        path = _stored_path(settings, upload)
        # The test's allowed roots (tmp_path) hold the storage path, as the defaults do.
        assert any(path.is_relative_to(root) for root in settings.resolved_allowed_roots)

        message = _source_problem(client, tenant_b, tmp_path, str(path))
        assert "uploads folder" in message and "not allowed" in message
        with session_factory() as session:
            assert session.scalar(select(func.count()).select_from(Run)) == 0

    def test_nor_the_uploads_folder_nor_a_link_into_it(
        self,
        client: TestClient,
        auth: dict[str, str],
        tenant_b: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.chdir(tmp_path)
        path = _stored_path(settings, _upload(client, auth))
        link = tmp_path / "innocent.jsonl"
        link.symlink_to(path)
        folder = tmp_path / "innocent-folder"
        folder.mkdir()
        (folder / "train.jsonl").symlink_to(path)
        for source in (str(path.parent), str(link), "./innocent.jsonl", str(folder)):
            assert "uploads folder" in _source_problem(client, tenant_b, tmp_path, source)

    def test_even_the_owner_names_its_file_by_id_not_by_path(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, settings: Settings
    ) -> None:
        # One way in, the one that checks the owner; a path would also outlive the file.
        path = _stored_path(settings, _upload(client, auth))
        assert "file_..." in _source_problem(client, auth, tmp_path, str(path))
