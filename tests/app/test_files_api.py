"""POST/GET /v1/files on a real database and a real storage folder."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.models import File
from app.settings import Settings
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
        stored = list((settings.resolved_storage_path / "files").iterdir())
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
        assert list((settings.resolved_storage_path / "files").iterdir()) == []

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
            from app.db import make_engine, make_session_factory

            engine = make_engine(small.resolved_database_url)
            auth = {"Authorization": f"Bearer {make_api_key(make_session_factory(engine))}"}
            engine.dispose()
            data = _jsonl(*({"text": "x" * 20} for _ in range(10)))
            response = client.post("/v1/files", files={"file": ("big.jsonl", data)}, headers=auth)
        assert response.status_code == 413
        assert "100-byte limit" in response.json()["detail"]
        assert list((small.resolved_storage_path / "files").iterdir()) == []

    def test_needs_an_api_key(self, client: TestClient) -> None:
        response = client.post("/v1/files", files={"file": ("d.jsonl", _jsonl({"text": "x"}))})
        assert response.status_code == 401


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
