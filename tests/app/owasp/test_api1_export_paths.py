"""OWASP API1 Broken Object Level Authorization: a run's model download serves that run's
export and nothing else. Issue 39 item 6: the checkpoint callback took any path inside
storage as the export, and `GET /v1/runs/{id}/model` tarred it, so a worker's token (which
anyone reading the Ray dashboard has) posting the uploads folder as its run's "export"
handed another key's private files to the run's owner; and a link inside a real export
sent its target's contents.

The tests have run A's worker post, as its export and as a checkpoint, the uploads folder,
another key's run folder, the storage itself, and A's folder left through `..` or a link,
on a local folder and on an S3 store: each is a 422 naming `path`, and nothing is recorded
or downloadable. An export that a database recorded before the rule is not served
either. And a real export holding links (to a file, to a folder) downloads without them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.storage.models import Run
from tests.app.conftest import start_run
from tests.app.worker_calls import run_location
from tests.conftest import S3Server, make_api_key

SECRET = b'{"text": "tenant b private row"}\n'


@pytest.fixture
def settings(
    request: pytest.FixtureRequest, tmp_path: Path, database_url: str, tiny_model_dir: Path
) -> Settings:
    """Storage on a local folder, or, with the parameter "s3", in an S3 bucket."""
    home = tmp_path / "home"
    home.mkdir()
    storage: str | None = None
    if getattr(request, "param", "local") == "s3":
        server: S3Server = request.getfixturevalue("s3_env")
        storage = f"s3://{server.create_bucket()}/tuneyard"
    return Settings(
        home=home,
        database_url=database_url,
        allowed_roots=f"{tmp_path}:{tiny_model_dir}",
        storage_path=storage,
    )


@pytest.fixture
def tenant_b(session_factory: sessionmaker[Session]) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}


def _post(
    client: TestClient, started: tuple[str, dict[str, str]], path: str, kind: str
) -> tuple[int, str]:
    run_id, worker = started
    body = {"attempt": 1, "step": 5, "path": path, "kind": kind}
    r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
    if r.status_code != 422:
        return r.status_code, r.text
    (problem,) = r.json()["detail"]
    return r.status_code, f"{problem['field']}: {problem['message']}"


class TestAWorkerPostsOnlyItsRunsOwnFolder:
    @pytest.mark.parametrize("settings", ["local", "s3"], indirect=True)
    def test_other_folders_in_storage_are_refused_and_nothing_is_recorded(
        self,
        client: TestClient,
        auth: dict[str, str],
        tenant_b: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, _ = started
        upload = client.post("/v1/files", files={"file": ("b.jsonl", SECRET)}, headers=tenant_b)
        assert upload.status_code == 201, upload.text
        (tmp_path / "b").mkdir()
        other_id, _ = start_run(client, tenant_b, tmp_path / "b", settings, session_factory)
        storage = settings.storage
        own = run_location(settings, run_id)
        posted = [
            settings.uploads_location,
            f"{settings.uploads_location}/",
            storage.join(other_id, "export"),
            storage.join(other_id),
            storage.root,
            storage.join("profiles"),
            f"{own}/../{other_id}/export",
            f"{own}/../files",
            f"{own}extra/export",  # a prefix of the name is not the folder
        ]
        for path in posted:
            for kind in ("hf", "adapter", "deepspeed"):
                status, text = _post(client, started, path, kind)
                assert status == 422, (path, kind, text)
                assert text.startswith("path:") and f"({own}/)" in text, text

        assert client.get(f"/v1/runs/{run_id}/checkpoints", headers=auth).json()["data"] == []
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["output"] == {"model_path": None, "latest_checkpoint": None}
        download = client.get(f"/v1/runs/{run_id}/model", headers=auth)
        assert download.status_code == 409, download.text
        assert SECRET not in download.content
        # The run's own folder is where its worker writes: that is taken.
        assert _post(client, started, f"{own}/export/", "hf")[0] == 200
        assert (
            run_location(settings, run_id, "export")
            == (client.get(f"/v1/runs/{run_id}", headers=auth).json()["output"]["model_path"])
        )

    def test_a_link_in_the_runs_folder_leads_nowhere_else(
        self,
        client: TestClient,
        tenant_b: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, _ = started
        (tmp_path / "b").mkdir()
        other_id, _ = start_run(client, tenant_b, tmp_path / "b", settings, session_factory)
        other = Path(run_location(settings, other_id, "export"))
        other.mkdir(parents=True)
        own = Path(run_location(settings, run_id))
        own.mkdir(parents=True, exist_ok=True)
        (own / "export").symlink_to(other)
        (own / "uploads").symlink_to(settings.uploads_dir)
        for path in (own / "export", own / "uploads", own / "export" / "sub"):
            status, text = _post(client, started, str(path), "hf")
            assert status == 422 and "is not inside this run's folder" in text, text


class TestTheDownloadServesTheRunsFolderOnly:
    def test_an_export_recorded_before_the_rule_is_not_served(
        self,
        client: TestClient,
        auth: dict[str, str],
        tenant_b: dict[str, str],
        session_factory: sessionmaker[Session],
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        # A database from before the callback refused it holds the uploads as the export.
        run_id, _ = started
        upload = client.post("/v1/files", files={"file": ("b.jsonl", SECRET)}, headers=tenant_b)
        assert upload.status_code == 201, upload.text
        with session_factory.begin() as session:
            run = session.get(Run, run_id)
            assert run is not None
            run.model_path = settings.uploads_location

        r = client.get(f"/v1/runs/{run_id}/model", headers=auth)
        assert r.status_code == 409, r.text
        assert "outside the run's own folder" in r.json()["detail"]
        assert SECRET not in r.content

    def test_a_link_inside_a_real_export_is_not_followed_into_the_tar(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, _ = started
        private = tmp_path / "private"
        (private / "deeper").mkdir(parents=True)
        (private / "secret.jsonl").write_bytes(SECRET)
        (private / "deeper" / "more.jsonl").write_bytes(SECRET)
        export = Path(run_location(settings, run_id, "export"))
        (export / "nested").mkdir(parents=True)
        (export / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        (export / "nested" / "weights.bin").write_bytes(b"weights")
        assert _post(client, started, str(export), "hf")[0] == 200
        # Links added once the export is recorded (one posted with them is refused: 422).
        (export / "tokenizer.json").symlink_to(private / "secret.jsonl")
        (export / "nested" / "linked").symlink_to(private)
        assert _post(client, started, str(export), "hf")[0] == 422

        r = client.get(f"/v1/runs/{run_id}/model", headers=auth)
        assert r.status_code == 200, r.text
        with tarfile.open(fileobj=io.BytesIO(r.content)) as archive:
            names = sorted(archive.getnames())
        assert names == ["config.json", "nested/weights.bin"]
        assert SECRET not in r.content
