"""POST/GET /v1/files on a real database and a real storage folder."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.services import files as files_service
from app.settings import Settings
from app.storage.db import transaction
from app.storage.models import File
from tests.conftest import make_api_key
from tests.factories import run_request


def _jsonl(*records: object) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


def _problems(response: object) -> list[str]:
    body = response.json()  # type: ignore[attr-defined]
    assert body["error"] == "validation_error", body
    return [p["message"] for p in body["detail"]]


def _count_files(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(File)) or 0)


class TestUploadFile:
    def test_a_good_jsonl_file_is_stored_and_described(
        self, client: TestClient, auth: dict[str, str], settings: Settings
    ) -> None:
        data = _jsonl({"text": "one", "id": 1}, {"text": "two", "id": 2}, {"text": "three"})
        response = client.post("/v1/files", files={"file": ("news.jsonl", data)}, headers=auth)

        assert response.status_code == 201, response.text
        body = response.json()
        assert body["id"].startswith("file_")
        assert (body["filename"], body["format"], body["records"]) == ("news.jsonl", "jsonl", 3)
        assert body["bytes"] == len(data)
        assert body["fields"] == ["text", "id"]
        stored = list((settings.uploads_dir).iterdir())
        assert [p.read_bytes() for p in stored] == [data]

        fetched = client.get(f"/v1/files/{body['id']}", headers=auth)
        assert fetched.status_code == 200
        assert fetched.json() == body

    def test_bad_records_are_reported_by_line_and_nothing_is_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        data = _jsonl(
            {"text": "fine"}, {"body": "no text"}, "{not json", "[1, 2]", {"text": ""}, {"text": 5}
        )
        response = client.post("/v1/files", files={"file": ("d.jsonl", data)}, headers=auth)

        assert response.status_code == 422
        assert _problems(response) == [
            "line 2: missing field 'text'",
            "line 3: not valid JSON (Expecting property name enclosed in double quotes)",
            "line 4: expected a JSON object, got list",
            "line 5: field 'text' is empty",
            "line 6: field 'text' must be text, got int",
        ]
        assert _count_files(session_factory) == 0
        assert list((settings.uploads_dir).iterdir()) == []

    def test_a_field_name_the_database_cannot_hold_is_refused_and_nothing_is_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        session_factory: sessionmaker[Session],
    ) -> None:
        """Field names are stored and listed with the file: a lone surrogate escape (no
        UTF-8 for it) or a NUL (not in PostgreSQL's text) once gave a 500 after the file
        was stored, and every later listing of the key's files failed too."""
        data = b'{"text": "x", "\\ud800": "y"}\n{"text": "x", "a\\u0000b": "y"}\n'
        response = client.post("/v1/files", files={"file": ("d.jsonl", data)}, headers=auth)

        assert response.status_code == 422, response.text
        assert _problems(response) == [
            "line 1: the field name '\\ud800' is not valid Unicode (a lone surrogate escape)",
            "line 2: the field name 'a\\x00b' holds a NUL character",
        ]
        assert _count_files(session_factory) == 0
        assert client.get("/v1/files", headers=auth).status_code == 200

    def test_csv_errors_give_file_line_numbers(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        data = b"prompt,completion\nhi,there\nquestion,\n"
        response = client.post(
            "/v1/files",
            files={"file": ("pc.csv", data)},
            data={"purpose": "prompt_completion"},
            headers=auth,
        )
        assert response.status_code == 422
        assert _problems(response) == ["line 3: field 'completion' is empty"]

    def test_parquet_is_read_row_by_row(self, client: TestClient, auth: dict[str, str]) -> None:
        buffer = io.BytesIO()
        table = pa.table({"sentence": ["good", "bad", None], "label": [1, 0, 1]})
        pq.write_table(table, buffer)
        ok = client.post(
            "/v1/files",
            files={"file": ("cls.parquet", buffer.getvalue())},
            data={"purpose": "sequence_classification", "text_field": "sentence"},
            headers=auth,
        )
        assert ok.status_code == 422
        assert _problems(ok) == ["row 3: missing field 'sentence'"]

        buffer = io.BytesIO()
        pq.write_table(pa.table({"sentence": ["good", "bad"], "label": [1, 0]}), buffer)
        ok = client.post(
            "/v1/files",
            files={"file": ("cls.parquet", buffer.getvalue())},
            data={"purpose": "sequence_classification", "text_field": "sentence"},
            headers=auth,
        )
        assert ok.status_code == 201, ok.text
        assert ok.json()["records"] == 2

    def test_other_file_types_are_refused(self, client: TestClient, auth: dict[str, str]) -> None:
        response = client.post("/v1/files", files={"file": ("notes.txt", b"hello")}, headers=auth)
        assert response.status_code == 422
        assert "must end in one of" in _problems(response)[0]

    def test_an_empty_file_is_refused(self, client: TestClient, auth: dict[str, str]) -> None:
        response = client.post("/v1/files", files={"file": ("e.jsonl", b"")}, headers=auth)
        assert response.status_code == 422
        assert _problems(response) == ["the file holds no records"]

    def test_too_large_is_413(self, settings: Settings, tmp_path: Path) -> None:
        small = settings.model_copy(update={"max_upload_bytes": 100})
        with TestClient(create_app(small, start_background=False)) as client:
            from app.storage.db import make_engine, make_session_factory

            engine = make_engine(small.resolved_database_url)
            auth = {"Authorization": f"Bearer {make_api_key(make_session_factory(engine))}"}
            engine.dispose()
            data = _jsonl(*({"text": "x" * 20} for _ in range(10)))
            response = client.post("/v1/files", files={"file": ("big.jsonl", data)}, headers=auth)
        assert response.status_code == 413
        assert "100-byte limit" in response.json()["detail"]
        assert list((small.uploads_dir).iterdir()) == []

    def test_needs_an_api_key(self, client: TestClient) -> None:
        response = client.post("/v1/files", files={"file": ("d.jsonl", _jsonl({"text": "x"}))})
        assert response.status_code == 401


class TestUploadOrder:
    """The row is committed before the file is moved into place; see app/services/files.py."""

    def test_a_failed_insert_leaves_no_file_behind(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        first = _jsonl({"text": "first"})
        kept = client.post("/v1/files", files={"file": ("a.jsonl", first)}, headers=auth)
        assert kept.status_code == 201, kept.text
        # The next upload gets the same id: its insert fails in the database, as a commit can.
        monkeypatch.setattr(files_service, "new_id", lambda prefix: kept.json()["id"])

        with pytest.raises(IntegrityError):
            client.post(
                "/v1/files", files={"file": ("b.jsonl", _jsonl({"text": "b"}))}, headers=auth
            )

        # Before, the second file was moved into place (over the first) before the commit.
        stored = list((settings.uploads_dir).iterdir())
        assert [(p.name, p.read_bytes()) for p in stored] == [(f"{kept.json()['id']}.jsonl", first)]

    def test_the_next_upload_settles_partial_files_left_by_a_crash(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        folder = settings.uploads_dir
        folder.mkdir(parents=True, exist_ok=True)
        an_hour_ago = time.time() - files_service.PARTIAL_MAX_AGE_S - 60

        def partial(file_id: str, *, old: bool) -> Path:
            path = folder / f"{file_id}.jsonl.partial"
            path.write_bytes(_jsonl({"text": file_id}))
            if old:
                os.utime(path, (an_hour_ago, an_hour_ago))
            return path

        # Killed before its commit: no row, so nobody will ever read it.
        orphan = partial("file_00000000000000000001", old=True)
        # Killed between its commit and its rename: the row names the final file.
        committed = partial("file_00000000000000000002", old=True)
        with transaction(session_factory) as session:
            session.add(
                File(
                    id="file_00000000000000000002",
                    owner_id="someone",
                    filename="c.jsonl",
                    format="jsonl",
                    purpose="text",
                    bytes=committed.stat().st_size,
                    records=1,
                    fields=["text"],
                    path=str(folder / "file_00000000000000000002.jsonl"),
                )
            )
        # Recent: an upload still in progress.
        in_progress = partial("file_00000000000000000003", old=False)

        response = client.post(
            "/v1/files", files={"file": ("d.jsonl", _jsonl({"text": "x"}))}, headers=auth
        )

        assert response.status_code == 201, response.text
        assert not orphan.exists()
        assert not committed.exists()
        assert (folder / "file_00000000000000000002.jsonl").read_bytes() == _jsonl(
            {"text": "file_00000000000000000002"}
        )
        assert in_progress.exists()


def _multipart(filename: str, data: bytes) -> tuple[bytes, dict[str, str]]:
    """A body with the filename as sent, unescaped (httpx would escape some characters)."""
    boundary = "tuneyard-test-boundary"
    body = (
        (
            f"--{boundary}\r\n"
            f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


class TestUploadedFileNames:
    @pytest.mark.parametrize(
        ("sent", "kept"),
        [
            ("../../../evil.jsonl", "evil.jsonl"),
            ("..\\..\\windows\\evil.jsonl", "evil.jsonl"),
            ("a\x00b.jsonl", "ab.jsonl"),
            ("new\nline.jsonl", "newline.jsonl"),
            ("x" * 300 + ".jsonl", "x" * 249 + ".jsonl"),
        ],
        ids=["dotdot", "backslashes", "nul", "newline", "long"],
    )
    def test_only_a_bounded_printable_base_name_is_kept(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        tmp_path: Path,
        sent: str,
        kept: str,
    ) -> None:
        data = _jsonl({"text": "a b"})
        body, headers = _multipart(sent, data)

        response = client.post("/v1/files", content=body, headers={**auth, **headers})

        assert response.status_code == 201, response.text
        file_id = response.json()["id"]
        assert response.json()["filename"] == kept
        assert client.get(f"/v1/files/{file_id}", headers=auth).json()["filename"] == kept
        # Storage names the file by its id, inside the files folder, whatever was sent.
        folder = settings.uploads_dir
        assert [p.name for p in folder.iterdir()] == [f"{file_id}.jsonl"]
        assert not list(tmp_path.rglob("evil.jsonl"))

    def test_a_name_with_no_base_name_is_refused(
        self, client: TestClient, auth: dict[str, str], settings: Settings
    ) -> None:
        body, headers = _multipart("..", _jsonl({"text": "a b"}))

        response = client.post("/v1/files", content=body, headers={**auth, **headers})

        assert "must end in one of" in _problems(response)[0]
        assert not (settings.uploads_dir).exists() or not list((settings.uploads_dir).iterdir())


class TestFilesInRuns:
    def test_a_run_can_train_on_an_uploaded_file(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        rows = _jsonl(*[{"text": f"a b {i}"} for i in range(4)])
        upload = client.post("/v1/files", files={"file": ("d.jsonl", rows)}, headers=auth).json()
        body = run_request(tmp_path, dataset={"source": upload["id"], "text_field": "text"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 201, response.text
        source = response.json()["spec"]["dataset"]["source"]
        assert Path(source).read_bytes() == rows

    def test_a_file_too_small_for_one_step_is_refused_before_any_compute(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        rows = _jsonl(*[{"text": f"a b {i}"} for i in range(3)])
        upload = client.post("/v1/files", files={"file": ("d.jsonl", rows)}, headers=auth).json()
        # 2 workers x batch 2 need 4 records for one step.
        body = run_request(tmp_path, dataset={"source": upload["id"], "text_field": "text"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        (problem,) = response.json()["detail"]
        assert problem["field"] == "training.batch_size_per_worker"
        assert "0 batches per worker per epoch" in problem["message"]

    def test_the_file_must_have_the_runs_fields(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        upload = client.post(
            "/v1/files", files={"file": ("d.jsonl", _jsonl({"text": "a b"}))}, headers=auth
        ).json()
        body = run_request(tmp_path, dataset={"source": upload["id"], "text_field": "body"})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "has no field 'body'" in response.json()["detail"][0]["message"]

    def test_another_principals_file_is_invisible(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        upload = client.post(
            "/v1/files", files={"file": ("d.jsonl", _jsonl({"text": "a b"}))}, headers=auth
        ).json()
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        assert client.get(f"/v1/files/{upload['id']}", headers=other).status_code == 404
        body = run_request(tmp_path, dataset={"source": upload["id"]})
        response = client.post("/v1/runs", json=body, headers=other)
        assert response.status_code == 422
        assert response.json()["detail"][0]["message"] == f"no uploaded file {upload['id']!r}"
