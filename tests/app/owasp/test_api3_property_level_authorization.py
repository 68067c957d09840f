"""OWASP API3 Broken Object Property Level Authorization: no answer of the service shows a
secret property. The Ray address's credentials, the database's password and the runs'
callback tokens are taken out of /healthz, run events, run errors, job logs, Ray's error
messages and the service's own log lines (one rule: app/logs.py `redact`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import RayJobs, RayUnavailable
from app.logs import TextFormatter
from app.settings import Settings
from app.storage.models import Event, Run
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import job_token
from tests.factories import run_request

RAY_TOKEN = "ray-cluster-" + "q7" * 20
RAY_ADDRESS = f"http://tuneyard:{RAY_TOKEN}@ray-head.internal:8265"
DB_PASSWORD = "db-pass-" + "z3" * 12
DATABASE_URL = f"postgresql+psycopg://tuneyard:{DB_PASSWORD}@db.internal:5432/tuneyard"


class CredentialedRay(ScriptedRay):
    """A Ray reached through an address that carries its credentials."""

    address = RAY_ADDRESS

    def reachable(self) -> bool:
        return True


def _start(
    client: TestClient,
    auth: dict[str, str],
    root: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> tuple[str, str, CredentialedRay]:
    """A run the app's Ray received: its id, its worker's token and that Ray."""
    run_id = str(client.post("/v1/runs", json=run_request(root), headers=auth).json()["id"])
    ray = dispatch_to(CredentialedRay(), settings, session_factory)
    assert isinstance(ray, CredentialedRay)
    client.app.state.tuneyard.jobs = ray  # type: ignore[attr-defined]
    return run_id, job_token(ray.submitted[-1]), ray


def _assert_no_secret(text: str, *secrets: str) -> None:
    for secret in (RAY_TOKEN, DB_PASSWORD, *secrets):
        assert secret not in text


class TestHealthz:
    def test_the_ray_address_is_shown_without_its_credentials(
        self, client: TestClient, auth: dict[str, str], settings: Settings
    ) -> None:
        client.app.state.tuneyard.jobs = CredentialedRay()  # type: ignore[attr-defined]
        r = client.get("/healthz")  # no API key: anyone who reaches the service
        assert r.status_code == 200, r.text
        ray = r.json()["ray"]
        assert ray["address"] == ray["dashboard_url"] == "http://***@ray-head.internal:8265"
        assert ray["reachable"] is True
        _assert_no_secret(r.text, "tuneyard:")


class TestRunEventsAndErrors:
    def test_a_worker_event_quoting_the_database_url_and_its_token_is_stored_redacted(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("TUNEYARD_DATABASE_URL", DATABASE_URL)
        run_id, token, _ = _start(client, auth, tmp_path, settings, session_factory)
        message = f"could not reach {DATABASE_URL} nor {RAY_ADDRESS} (token {token})"
        r = client.post(
            f"/v1/internal/runs/{run_id}/events",
            json={"attempt": 1, "type": "message", "message": message},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200, r.text

        served = client.get(f"/v1/runs/{run_id}/events", headers=auth).json()["data"][-1]
        assert served["message"] == (
            "could not reach postgresql+psycopg://***@db.internal:5432/tuneyard "
            "nor http://***@ray-head.internal:8265 (token [redacted])"
        )
        with session_factory() as session:
            stored = session.scalars(select(Event.message).where(Event.run_id == run_id)).all()
        _assert_no_secret("\n".join(stored), token)

    def test_a_failure_message_with_secrets_is_stored_and_served_redacted(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id, token, _ = _start(client, auth, tmp_path, settings, session_factory)
        error = {
            "code": "training_error",
            "message": f"posting with {token} to {RAY_ADDRESS} failed; dsn "
            f"host=db.internal password={DB_PASSWORD} user=tuneyard",
        }
        r = client.post(
            f"/v1/internal/runs/{run_id}/status",
            json={"attempt": 1, "status": "failed", "error": error},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200, r.text

        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["error"]["message"] == (
            "posting with [redacted] to http://***@ray-head.internal:8265 failed; dsn "
            "host=db.internal password=[redacted] user=tuneyard"
        )
        events = client.get(f"/v1/runs/{run_id}/events", headers=auth).text
        _assert_no_secret(events, token)
        with session_factory() as session:
            stored = session.get(Run, run_id)
            assert stored is not None
            _assert_no_secret(stored.error_message or "", token)

    def test_an_api_key_quoted_in_an_event_is_redacted(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id, token, _ = _start(client, auth, tmp_path, settings, session_factory)
        api_key = auth["Authorization"].removeprefix("Bearer ")
        client.post(
            f"/v1/internal/runs/{run_id}/events",
            json={"attempt": 1, "type": "message", "message": f"key={api_key}"},
            headers={"Authorization": f"Bearer {token}"},
        )
        served = client.get(f"/v1/runs/{run_id}/events", headers=auth).json()["data"][-1]
        assert served["message"] == "key=[redacted]"


class TestJobLogs:
    def test_the_job_log_is_served_without_tokens_urls_credentials_or_passwords(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("TUNEYARD_DATABASE_URL", DATABASE_URL)
        run_id, token, ray = _start(client, auth, tmp_path, settings, session_factory)
        ray.logs_text = "\n".join(
            [
                f"TUNEYARD_RUN_TOKEN={token}",
                f"posting to the service with Authorization: Bearer {token}",
                f"RAY_ADDRESS={RAY_ADDRESS}",
                f"sqlalchemy: {DATABASE_URL}",
                "step 1 loss 4.9",
            ]
        )
        r = client.get(f"/v1/runs/{run_id}/logs", headers=auth)
        assert r.status_code == 200, r.text
        assert r.text.splitlines() == [
            "TUNEYARD_RUN_TOKEN=[redacted]",
            "posting to the service with Authorization: Bearer [redacted]",
            "RAY_ADDRESS=http://***@ray-head.internal:8265",
            "sqlalchemy: postgresql+psycopg://***@db.internal:5432/tuneyard",
            "step 1 loss 4.9",
        ]


class TestRayErrorsAndServiceLogs:
    def test_an_unreachable_credentialed_ray_is_named_without_its_token(self) -> None:
        # A real client against a port nothing listens on: Ray's own error quotes the URL.
        jobs = RayJobs(f"http://tuneyard:{RAY_TOKEN}@127.0.0.1:9")
        with pytest.raises(RayUnavailable) as caught:
            jobs.submit(submission_id="run_x-1", entrypoint="true", runtime_env={})
        assert "cannot reach Ray at http://***@127.0.0.1:9" in str(caught.value)
        _assert_no_secret(str(caught.value))

    def test_a_service_log_line_quoting_secrets_is_written_redacted(self) -> None:
        record = logging.LogRecord(
            "tuneyard", logging.WARNING, __file__, 1, "cannot reach Ray at %s: %s", None, None
        )
        record.args = (RAY_ADDRESS, f"database {DATABASE_URL} down")
        record.run_id = "run_abc"
        line = TextFormatter("%(levelname)s %(message)s").format(record)
        assert line == (
            "WARNING cannot reach Ray at http://***@ray-head.internal:8265: database "
            "postgresql+psycopg://***@db.internal:5432/tuneyard down run_id=run_abc"
        )
