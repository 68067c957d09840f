"""GET /v1/runs/{id}/model and `tuneyard download`: the exported model, out of storage
(a local folder, or a real S3-compatible server), loads with from_pretrained."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from app.cli.client import ApiError, TuneyardClient
from app.main import create_app
from app.settings import Settings
from tests.app.conftest import served
from tests.conftest import S3Server


@pytest.fixture(params=["local", "s3"])
def settings(
    request: pytest.FixtureRequest, tmp_path: Path, database_url: str, tiny_model_dir: Path
) -> Settings:
    home = tmp_path / "home"
    home.mkdir()
    storage: str | None = None
    if request.param == "s3":
        server: S3Server = request.getfixturevalue("s3_env")
        storage = f"s3://{server.create_bucket()}/tuneyard"
    return Settings(
        home=home,
        database_url=database_url,
        allowed_roots=f"{tmp_path}:{tiny_model_dir}",
        storage_path=storage,
    )


def _export(
    client: TestClient,
    settings: Settings,
    started: tuple[str, dict[str, str]],
    model_dir: Path,
) -> str:
    """Put a model where the run's worker exports it, and post the export as it does."""
    run_id, worker = started
    location = settings.storage.join(run_id, "export")
    settings.storage.put(model_dir, location)
    body = {"attempt": 1, "step": 2, "epoch": 1.0, "path": location, "kind": "hf", "metrics": {}}
    r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
    assert r.status_code == 200, r.text
    return location


def test_the_model_downloads_as_a_tar_that_loads(
    client: TestClient,
    auth: dict[str, str],
    settings: Settings,
    started: tuple[str, dict[str, str]],
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    run_id = started[0]
    location = _export(client, settings, started, tiny_model_dir)
    assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["output"]["model_path"] == (
        location
    )
    r = client.get(f"/v1/runs/{run_id}/model", headers=auth)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert f'filename="{run_id}-model.tar"' in r.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(r.content)) as archive:
        names = sorted(archive.getnames())
        archive.extractall(tmp_path / "out", filter="data")
    assert names == sorted(p.name for p in tiny_model_dir.iterdir() if p.is_file())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for (name, a), (_, b) in zip(
        loaded.state_dict().items(), original.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_cli_downloads_into_a_new_folder(
    settings: Settings,
    client: TestClient,
    auth: dict[str, str],
    api_key: str,
    started: tuple[str, dict[str, str]],
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    run_id = started[0]
    _export(client, settings, started, tiny_model_dir)
    with served(create_app(settings, start_background=False)) as url:
        dest = tmp_path / "my-model"

        def download() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "app", "download", run_id, str(dest)],
                env={"TUNEYARD_URL": url, "TUNEYARD_API_KEY": api_key, "PATH": ""},
                capture_output=True,
                text=True,
                timeout=120,
            )

        result = download()
        assert result.returncode == 0, result.stderr
        assert f"model in {dest}" in result.stdout
        config = json.loads((dest / "config.json").read_text())
        assert config == json.loads((tiny_model_dir / "config.json").read_text())
        AutoModelForCausalLM.from_pretrained(dest)
        # An existing folder is never written into.
        again = download()
        assert again.returncode == 2 and "already exists" in again.stderr
        # A refused download leaves no folder behind.
        with TuneyardClient(url, "not-a-key") as stranger, pytest.raises(ApiError) as refused:
            stranger.download_model(run_id, tmp_path / "theirs")
        assert refused.value.status_code == 401
        assert not (tmp_path / "theirs").exists()
        assert not list(tmp_path.glob(".theirs*"))


def test_a_run_without_an_export_is_a_conflict_that_says_why(
    client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
) -> None:
    r = client.get(f"/v1/runs/{started[0]}/model", headers=auth)
    assert r.status_code == 409
    assert "has no exported model" in r.json()["detail"]


def test_an_export_gone_from_storage_is_not_found(
    client: TestClient,
    auth: dict[str, str],
    settings: Settings,
    started: tuple[str, dict[str, str]],
    tiny_model_dir: Path,
) -> None:
    location = _export(client, settings, started, tiny_model_dir)
    settings.storage.delete(location)
    r = client.get(f"/v1/runs/{started[0]}/model", headers=auth)
    assert r.status_code == 404
    assert "no longer in storage" in r.json()["detail"]


def test_another_tenants_run_is_not_found(
    client: TestClient,
    settings: Settings,
    started: tuple[str, dict[str, str]],
    tiny_model_dir: Path,
    session_factory: object,
) -> None:
    from tests.conftest import make_api_key

    _export(client, settings, started, tiny_model_dir)
    other = {"Authorization": f"Bearer {make_api_key(session_factory, name='team-b')}"}  # type: ignore[arg-type]
    assert client.get(f"/v1/runs/{started[0]}/model", headers=other).status_code == 404


def test_an_object_store_that_stops_answering_is_a_503(
    tmp_path: Path,
    database_url: str,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from app.storage.db import make_engine, make_session_factory
    from app.storage.migrate import upgrade_database
    from tests.app.test_dispatch import ScriptedRay, dispatch_to
    from tests.app.worker_calls import worker_headers
    from tests.conftest import make_api_key, running_s3_server
    from tests.factories import run_request

    with running_s3_server(tmp_path / "moto.log") as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        settings = Settings(
            home=tmp_path / "home",
            database_url=database_url,
            allowed_roots=f"{tmp_path}:{tiny_model_dir}",
            storage_path=f"s3://{server.create_bucket()}/tuneyard",
        )
        upgrade_database(settings.resolved_database_url)
        factory = make_session_factory(make_engine(settings.resolved_database_url))
        auth = {"Authorization": f"Bearer {make_api_key(factory)}"}
        client = TestClient(create_app(settings, start_background=False))
        client.__enter__()
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        ray = dispatch_to(ScriptedRay(), settings, factory)
        _export(client, settings, (run_id, worker_headers(ray)), tiny_model_dir)
    try:
        r = client.get(f"/v1/runs/{run_id}/model", headers=auth)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "storage_unavailable"
        assert settings.storage.root in r.json()["detail"]
    finally:
        client.__exit__(None, None, None)
