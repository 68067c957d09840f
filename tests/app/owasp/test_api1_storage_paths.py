"""OWASP API1 Broken Object Level Authorization: what a run leaves in the service's storage
(its checkpoints and exports) is its API key's object, like an uploaded file. Issue 39
item 3: the default allowed roots ($TUNEYARD_HOME) hold the storage folder and only its
uploads were refused, so tenant B trained from tenant A's export by naming
`<home>/storage/<A's run id>/export`, while naming A's run id was refused.

The tests have key A's run export a model, then key B name it by path every way a path
can be written (directly, through `..`, through a link inside an allowed root, with a
trailing slash, relative to the working directory), as the model, as dataset and eval
data, through validate and the OpenAI route, under the test's allowed roots and the
default ones; and files of the service's own (profiles, the Ray head's state) as data.
Each is a 422 naming the field and the rule, with nothing stored, while A still trains
from its run through the run's id."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.storage.models import Run
from tests.app.worker_calls import run_location
from tests.conftest import make_api_key
from tests.factories import run_request


@pytest.fixture
def settings(request: pytest.FixtureRequest, tmp_path: Path, database_url: str) -> Settings:
    """The test's roots (tmp_path, which holds $TUNEYARD_HOME and so the storage), or, with
    the parameter "default roots", TUNEYARD_ALLOWED_ROOTS unset: $TUNEYARD_HOME itself."""
    if getattr(request, "param", "configured roots") == "default roots":
        return Settings(home=tmp_path, database_url=database_url)
    home = tmp_path / "home"
    home.mkdir()
    return Settings(home=home, database_url=database_url, allowed_roots=str(tmp_path))


@pytest.fixture
def tenant_b(session_factory: sessionmaker[Session]) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}


@pytest.fixture
def export(client: TestClient, settings: Settings, started: tuple[str, dict[str, str]]) -> Path:
    """Key A's run (`auth`) exported a model, as its worker writes and posts it."""
    run_id, worker = started
    folder = Path(run_location(settings, run_id, "export"))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (folder / "tokenizer.json").write_text(json.dumps({"text": "tenant a's vocabulary"}))
    body = {"attempt": 1, "step": 5, "path": str(folder), "kind": "hf"}
    r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
    assert r.status_code == 200, r.text
    return folder


def _problems(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> dict[str, str]:
    """POST the run; assert 422 and return {field: message}."""
    response = client.post("/v1/runs", json=body, headers=auth)
    assert response.status_code == 422, response.text
    return {p["field"]: p["message"] for p in response.json()["detail"]}


def _runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Run)) or 0


def _in_storage(message: str) -> bool:
    return "in the service's storage, which is not allowed" in message and "'run_...'" in message


class TestAnotherKeysExportByPath:
    @pytest.mark.parametrize("settings", ["configured roots", "default roots"], indirect=True)
    def test_the_export_path_is_refused_where_its_run_id_is(
        self,
        client: TestClient,
        tenant_b: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        export: Path,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, _ = started
        # Whichever roots: they hold the export.
        assert any(export.is_relative_to(root) for root in settings.resolved_allowed_roots)
        refused_id = _problems(client, tenant_b, run_request(tmp_path, model=run_id))
        assert refused_id["model"] == f"no run {run_id!r}"

        assert _in_storage(
            _problems(client, tenant_b, run_request(tmp_path, model=str(export)))["model"]
        )
        checked = client.post(
            "/v1/runs/validate", json=run_request(tmp_path, model=str(export)), headers=tenant_b
        )
        assert checked.status_code == 200, checked.text
        assert checked.json()["valid"] is False
        assert [e["field"] for e in checked.json()["errors"]] == ["model"]
        assert _runs(session_factory) == 1  # A's alone

    def test_nor_by_dot_dot_a_link_a_trailing_slash_or_relative(
        self,
        client: TestClient,
        tenant_b: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        export: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "innocent-model").symlink_to(export)
        (tmp_path / "everything").symlink_to(tmp_path / "home")
        written = [
            f"{tmp_path}/model/../{export.relative_to(tmp_path)}",
            str(tmp_path / "innocent-model"),
            f"{tmp_path}/everything/{export.relative_to(tmp_path / 'home')}",
            f"{export}/",
            f"{export}//.",
            f"./{os.path.relpath(export, tmp_path)}",
        ]
        for model in written:
            message = _problems(client, tenant_b, run_request(tmp_path, model=model))["model"]
            assert _in_storage(message), (model, message)
        assert _runs(session_factory) == 1

    @pytest.mark.parametrize("field", ["source", "eval_source"])
    def test_nor_its_files_as_data(
        self,
        client: TestClient,
        tenant_b: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        export: Path,
        field: str,
    ) -> None:
        folder = tmp_path / "innocent-folder"
        folder.mkdir()
        (folder / "train.json").symlink_to(export / "tokenizer.json")
        for source in (str(export / "tokenizer.json"), str(export)):
            body = run_request(tmp_path, dataset={field: source})
            assert _in_storage(_problems(client, tenant_b, body)[f"dataset.{field}"]), source
        # A folder that holds the storage, or links into it.
        for source, entry in ((tmp_path / "home", "storage"), (folder, "train.json")):
            body = run_request(tmp_path, dataset={field: str(source)})
            message = _problems(client, tenant_b, body)[f"dataset.{field}"]
            assert f"{entry!r} in it leads into the service's storage" in message
        assert _runs(session_factory) == 1

    def test_nor_through_the_openai_route(
        self,
        client: TestClient,
        tenant_b: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        export: Path,
    ) -> None:
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        rows = json.dumps({"messages": turns}) + "\n"
        upload = client.post(
            "/v1/files",
            files={"file": ("chat.jsonl", rows.encode())},
            data={"purpose": "fine-tune"},
            headers=tenant_b,
        )
        assert upload.status_code == 201, upload.text
        job = {"model": str(export), "training_file": upload.json()["id"]}
        response = client.post("/v1/fine_tuning/jobs", json=job, headers=tenant_b)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and _in_storage(error["message"]), error
        assert _runs(session_factory) == 1


class TestTheOwnersWayIn:
    def test_the_owner_trains_from_its_run_by_id_not_by_path(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        export: Path,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, _ = started
        created = client.post("/v1/runs", json=run_request(tmp_path, model=run_id), headers=auth)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["model"] == str(export)
        # One way in, the one that checks the owner; a path would also outlive the run.
        assert _in_storage(
            _problems(client, auth, run_request(tmp_path, model=str(export)))["model"]
        )


class TestTheServicesOwnFiles:
    def test_profiles_and_the_ray_heads_state_are_not_data(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        profile = Path(settings.storage.join("profiles", "profile-x.json"))
        profile.parent.mkdir(parents=True)
        profile.write_text(json.dumps({"text": "another key's measurements"}))
        head = settings.ray_state_dir / "head.json"
        head.parent.mkdir(parents=True)
        head.write_text(json.dumps({"text": "the head's address and token"}))

        body = run_request(tmp_path, dataset={"source": str(profile)})
        assert _in_storage(_problems(client, auth, body)["dataset.source"])
        body = run_request(tmp_path, dataset={"source": str(head)})
        message = _problems(client, auth, body)["dataset.source"]
        assert "in the service's state folder, which is not allowed" in message
        assert _runs(session_factory) == 0
