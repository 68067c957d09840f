"""Uploads with storage on a real S3-compatible server: received and checked on the
service's disk, kept as objects, read back by resume's check, removed with the file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.settings import Settings
from app.storage.models import Run
from tests.conftest import S3Server, make_api_key

ROWS = b"".join(b'{"text": "row %d of the news"}\n' % i for i in range(40))


@pytest.fixture
def s3_settings(
    tmp_path: Path, database_url: str, tiny_model_dir: Path, s3_env: S3Server
) -> Settings:
    home = tmp_path / "home"
    home.mkdir()
    return Settings(
        home=home,
        database_url=database_url,
        allowed_roots=f"{tmp_path}:{tiny_model_dir}",
        storage_path=f"s3://{s3_env.create_bucket()}/tuneyard",
    )


def test_an_upload_is_an_object_until_it_is_deleted(
    s3_settings: Settings, s3_env: S3Server, tiny_model_dir: Path
) -> None:
    from app.storage.db import make_engine, make_session_factory
    from app.storage.migrate import upgrade_database

    upgrade_database(s3_settings.resolved_database_url)
    factory: sessionmaker[Session] = make_session_factory(
        make_engine(s3_settings.resolved_database_url)
    )
    auth = {"Authorization": f"Bearer {make_api_key(factory)}"}
    bucket = s3_settings.storage.root.split("/")[2]
    with TestClient(create_app(s3_settings, start_background=False)) as client:
        r = client.post("/v1/files", files={"file": ("news.jsonl", ROWS)}, headers=auth)
        assert r.status_code == 201, r.text
        file_id = r.json()["id"]
        assert s3_env.keys(bucket) == [f"tuneyard/files/{file_id}.jsonl"]
        assert list(s3_settings.uploads_dir.iterdir()) == []  # nothing left on local disk

        body = {
            "model": str(tiny_model_dir),
            "dataset": {"source": file_id},
            "training": {"max_steps": 2, "seq_length": 32},
            "resources": {"num_workers": 1},
        }
        report = client.post("/v1/runs/validate", json=body, headers=auth)
        assert report.status_code == 200 and report.json()["valid"], report.text
        run = client.post("/v1/runs", json=body, headers=auth)
        # The stored run reads back whole (its source is a URI the service wrote).
        assert client.get(f"/v1/runs/{run.json()['id']}", headers=auth).status_code == 200
        assert run.status_code == 201, run.text
        source = run.json()["spec"]["dataset"]["source"]
        assert source == f"{s3_settings.storage.root}/files/{file_id}.jsonl"

        # A finished run reading the file lets it go; resume then finds it gone.
        with factory.begin() as session:
            stored = session.get(Run, run.json()["id"])
            assert stored is not None
            stored.status = "failed"
        assert client.delete(f"/v1/files/{file_id}", headers=auth).status_code == 200
        # pyarrow leaves the emptied "folder" as a marker object: no file is left.
        assert [key for key in s3_env.keys(bucket) if not key.endswith("/")] == []
        resumed = client.post(f"/v1/runs/{run.json()['id']}/resume", headers=auth)
        assert resumed.status_code == 409
        assert "no longer exists" in resumed.json()["detail"]


def _prompt_rows_lacking_an_answer(fmt: str) -> bytes:
    """Prompts with the field the grader reads, but for the second record's."""
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2="},
        {"prompt": "3+3=", "answer": "6"},
    ]
    if fmt == "jsonl":
        return b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


@pytest.mark.parametrize(
    ("fmt", "said"),
    [
        ("jsonl", "line 2: record has no field 'answer'"),
        # Parquet gives every row each column: the second's answer is null.
        ("parquet", "row 2: record's field 'answer' is null"),
    ],
)
def test_an_uploads_records_are_read_from_the_object_store_for_what_the_grader_reads(
    s3_settings: Settings, tiny_model_dir: Path, fmt: str, said: str
) -> None:
    """A grpo run's grader reads {{item.answer}}: each of the upload's records must have
    it, as each of a local file's must, read from the object where storage keeps it."""
    from app.storage.db import make_engine, make_session_factory
    from app.storage.migrate import upgrade_database

    upgrade_database(s3_settings.resolved_database_url)
    factory: sessionmaker[Session] = make_session_factory(
        make_engine(s3_settings.resolved_database_url)
    )
    auth = {"Authorization": f"Bearer {make_api_key(factory)}"}
    with TestClient(create_app(s3_settings, start_background=False)) as client:
        r = client.post(
            "/v1/files",
            files={"file": (f"prompts.{fmt}", _prompt_rows_lacking_an_answer(fmt))},
            data={"purpose": "prompt"},
            headers=auth,
        )
        assert r.status_code == 201, r.text
        grader = {
            "type": "string_check",
            "name": "answer",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        }
        body = {
            "model": str(tiny_model_dir),
            "dataset": {"source": r.json()["id"], "format": "prompt"},
            "method": {"type": "grpo", "grader": grader, "max_completion_tokens": 32},
            "training": {"max_steps": 2, "seq_length": 32},
            "resources": {"num_workers": 1},
        }
        refused = client.post("/v1/runs", json=body, headers=auth)
        assert refused.status_code == 422, refused.text
        fields = {e["field"]: e["message"] for e in refused.json()["detail"]}
        assert said in fields["dataset.source"], fields
        assert list(fields) == ["dataset.source"]
