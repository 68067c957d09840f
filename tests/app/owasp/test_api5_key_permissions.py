"""OWASP API5:2023 Broken Function Level Authorization: what an API key's runs may do is its
operator's to grant, not the tenant's to take.

The finding: a key capped by `max_priority` could still submit `preemptible: false` and hold
resources that no run of higher priority can take back, the very thing the cap is there to
prevent. And every run tracks under the service's MLflow and W&B credentials while the
tenant names the experiment, project and entity, so it could write into another team's.

Non-preemptible runs are a permission now (`allow_non_preemptible`; unset: allowed unless
`max_priority` caps the key), checked on create, validate, OpenAI jobs and resume. An
operator may pin a key's tracking: with `tracking_prefix` the MLflow experiment and W&B
project must start with it (unset: the prefix and the default name), with `wandb_entity`
that entity only (unset: it). The tests try each with a capped key, a granted one and an
unlimited one (whose runs are as before), on SQLite and PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.services.api_keys import create_api_key
from app.settings import Settings
from app.storage.db import transaction
from app.storage.models import ApiKey, Run
from tests.factories import local_inputs, run_request


@pytest.fixture
def settings(tmp_path: Path, database_url: str, tiny_model_dir: Path) -> Settings:
    """The shared fixture's settings, with an MLflow server for the runs that track."""
    home = tmp_path / "home"
    home.mkdir()
    return Settings(
        home=home,
        database_url=database_url,
        allowed_roots=f"{tmp_path}:{tiny_model_dir}",
        mlflow_tracking_uri="http://mlflow.internal:5000",
    )


def _key(session_factory: sessionmaker[Session], name: str, **settings: Any) -> dict[str, str]:
    """The headers of a new key with these limits and permissions (as `tuneyard keys create`
    sets them: tests/app/cli/test_cli.py)."""
    with transaction(session_factory) as session:
        key, secret = create_api_key(session, name=name)
        for column, value in settings.items():
            setattr(key, column, value)
    return {"Authorization": f"Bearer {secret}"}


def _update(session_factory: sessionmaker[Session], name: str, **settings: Any) -> None:
    with transaction(session_factory) as session:
        key = session.scalars(select(ApiKey).where(ApiKey.name == name)).one()
        for column, value in settings.items():
            setattr(key, column, value)


def _refused(response: Any) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {p["field"]: p["message"] for p in response.json()["detail"]}


def _runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Run)) or 0


class TestNonPreemptibleIsAPermission:
    def test_a_capped_key_cannot_hold_what_no_higher_priority_can_take_back(
        self,
        client: TestClient,
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        capped = _key(session_factory, "capped", max_priority=60)
        body = run_request(tmp_path, preemptible=False)
        message = _refused(client.post("/v1/runs", json=body, headers=capped))["preemptible"]
        assert "max_priority (60)" in message and "--allow-non-preemptible" in message
        assert _runs(session_factory) == 0
        report = client.post("/v1/runs/validate", json=body, headers=capped).json()
        assert report["valid"] is False
        assert [e["field"] for e in report["errors"]] == ["preemptible"]
        # Preemptible runs, the default, are what the cap allows.
        assert client.post("/v1/runs", json=run_request(tmp_path), headers=capped).is_success
        # Until an operator grants it.
        _update(session_factory, "capped", allow_non_preemptible=True)
        created = client.post("/v1/runs", json=body, headers=capped)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["preemptible"] is False

    def test_nor_through_openais_extension(
        self,
        client: TestClient,
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        capped = _key(session_factory, "capped", max_priority=60)
        records = b'{"text": "a line of text"}\n' * 64
        upload = client.post(
            "/v1/files", files={"file": ("a.jsonl", records)}, headers=capped
        ).json()
        model, _ = local_inputs(tmp_path)
        job = {
            "model": str(model),
            "training_file": upload["id"],
            "tuneyard": {"preemptible": False},
        }
        answer = client.post("/v1/fine_tuning/jobs", json=job, headers=capped)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "preemptible"
        assert _runs(session_factory) == 0

    def test_an_unlimited_key_may_as_before_unless_an_operator_says_no(
        self, client: TestClient, tmp_path: Path, session_factory: sessionmaker[Session]
    ) -> None:
        unlimited = _key(session_factory, "unlimited")
        body = run_request(tmp_path, preemptible=False)
        assert client.post("/v1/runs", json=body, headers=unlimited).status_code == 201
        _update(session_factory, "unlimited", allow_non_preemptible=False)
        message = _refused(client.post("/v1/runs", json=body, headers=unlimited))["preemptible"]
        assert "allow_non_preemptible is off" in message

    def test_a_resume_is_checked_again(
        self, client: TestClient, tmp_path: Path, session_factory: sessionmaker[Session]
    ) -> None:
        """A run made while allowed does not keep the permission past its withdrawal."""
        granted = _key(session_factory, "granted", max_priority=60, allow_non_preemptible=True)
        body = run_request(tmp_path, preemptible=False)
        run = client.post("/v1/runs", json=body, headers=granted).json()
        assert client.post(f"/v1/runs/{run['id']}/cancel", headers=granted).is_success
        _update(session_factory, "granted", allow_non_preemptible=None)
        resumed = client.post(f"/v1/runs/{run['id']}/resume", headers=granted)
        assert "preemptible" in _refused(resumed)
        status = client.get(f"/v1/runs/{run['id']}", headers=granted).json()["status"]
        assert status == "cancelled"


class TestTrackingDestinationsArePinned:
    @pytest.fixture(autouse=True)
    def no_wandb_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("WANDB_API_KEY", raising=False)

    def test_names_outside_the_keys_prefix_are_refused(
        self, client: TestClient, tmp_path: Path, session_factory: sessionmaker[Session]
    ) -> None:
        team_a = _key(session_factory, "team-a", tracking_prefix="team-a-")
        tracking = {
            "mlflow": {"experiment": "team-b-secrets"},
            "wandb": {"project": "team-b-secrets", "mode": "offline"},
        }
        response = client.post(
            "/v1/runs", json=run_request(tmp_path, tracking=tracking), headers=team_a
        )
        problems = _refused(response)
        assert set(problems) == {"tracking.mlflow.experiment", "tracking.wandb.project"}
        assert "'team-a-'" in problems["tracking.mlflow.experiment"]
        assert _runs(session_factory) == 0
        # A key without a prefix tracks anywhere, as before.
        unpinned = _key(session_factory, "unpinned")
        body = run_request(tmp_path, tracking=tracking)
        assert client.post("/v1/runs", json=body, headers=unpinned).status_code == 201

    def test_names_inside_it_are_kept_and_unset_ones_get_it(
        self, client: TestClient, tmp_path: Path, session_factory: sessionmaker[Session]
    ) -> None:
        team_a = _key(session_factory, "team-a", tracking_prefix="team-a-")
        named = {"mlflow": {"experiment": "team-a-sft"}, "wandb": {"mode": "offline"}}
        run = client.post("/v1/runs", json=run_request(tmp_path, tracking=named), headers=team_a)
        assert run.status_code == 201, run.text
        tracking = run.json()["spec"]["tracking"]
        assert tracking["mlflow"]["experiment"] == "team-a-sft"
        assert tracking["wandb"]["project"] == "team-a-tuneyard"
        # As the worker will read it: stored so.
        stored = client.get(f"/v1/runs/{run.json()['id']}", headers=team_a).json()
        assert stored["spec"]["tracking"]["wandb"]["project"] == "team-a-tuneyard"
        # Validate answers what create does: unset names are not the tenant's choice.
        checked = client.post(
            "/v1/runs/validate", json=run_request(tmp_path, tracking=named), headers=team_a
        )
        assert checked.status_code == 200, checked.text
        assert checked.json()["valid"] is True, checked.json()

    def test_the_wandb_entity_is_pinned(
        self, client: TestClient, tmp_path: Path, session_factory: sessionmaker[Session]
    ) -> None:
        team_a = _key(session_factory, "team-a", wandb_entity="acme-team-a")
        other = {"wandb": {"entity": "acme-team-b", "mode": "offline"}}
        refused = client.post(
            "/v1/runs", json=run_request(tmp_path, tracking=other), headers=team_a
        )
        assert "'acme-team-a'" in _refused(refused)["tracking.wandb.entity"]
        unset = {"wandb": {"project": "anything", "mode": "offline"}}
        run = client.post("/v1/runs", json=run_request(tmp_path, tracking=unset), headers=team_a)
        assert run.status_code == 201, run.text
        assert run.json()["spec"]["tracking"]["wandb"]["entity"] == "acme-team-a"
        assert run.json()["spec"]["tracking"]["wandb"]["project"] == "anything"

    def test_a_resume_is_checked_against_the_pin_of_now(
        self, client: TestClient, tmp_path: Path, session_factory: sessionmaker[Session]
    ) -> None:
        team_a = _key(session_factory, "team-a")
        tracking = {"mlflow": {"experiment": "team-b-secrets"}}
        run = client.post(
            "/v1/runs", json=run_request(tmp_path, tracking=tracking), headers=team_a
        ).json()
        assert client.post(f"/v1/runs/{run['id']}/cancel", headers=team_a).is_success
        _update(session_factory, "team-a", tracking_prefix="team-a-")
        resumed = client.post(f"/v1/runs/{run['id']}/resume", headers=team_a)
        assert "tracking.mlflow.experiment" in _refused(resumed)
