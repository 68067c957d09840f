"""OWASP API2 Broken Authentication: API keys can be revoked, and a revoked key is refused
at once, by every service process that shares the database (no cached principal outlives
a revocation)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from app.cli.commands import ExitCode
from app.cli.commands import app as cli
from app.main import create_app
from app.services.api_keys import find_api_key, revoke_api_key
from app.settings import Settings
from app.storage.db import transaction
from tests.conftest import make_api_key
from tests.factories import run_request


@pytest.fixture
def replica(settings: Settings) -> Iterator[TestClient]:
    """A second service process on the same database."""
    with TestClient(create_app(settings, start_background=False)) as second:
        yield second


def revoke_with_cli(settings: Settings, ref: str) -> str:
    env = {"TUNEYARD_DATABASE_URL": settings.resolved_database_url, "COLUMNS": "200"}
    result = CliRunner().invoke(cli, ["keys", "revoke", ref], env=env, catch_exceptions=False)
    assert result.exit_code == ExitCode.OK, result.stderr
    return str(result.stdout)


class TestRevokedKey:
    def test_the_next_request_is_refused_by_every_replica(
        self,
        client: TestClient,
        replica: TestClient,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        key = make_api_key(session_factory, name="ci-bot")
        auth = {"Authorization": f"Bearer {key}"}
        # Both replicas have seen the key work (and could remember it).
        for service in (client, replica):
            for _ in range(3):
                assert service.get("/v1/runs", headers=auth).status_code == 200

        printed = revoke_with_cli(settings, "ci-bot")
        assert "revoked" in printed

        for service in (client, replica):
            response = service.get("/v1/runs", headers=auth)
            assert response.status_code == 401
            assert response.json()["error"] == "unauthorized"

    def test_revoking_one_key_leaves_the_others_working(
        self, client: TestClient, replica: TestClient, session_factory: sessionmaker[Session]
    ) -> None:
        kept = make_api_key(session_factory, name="team-a")
        gone = make_api_key(session_factory, name="team-b")
        for service in (client, replica):
            assert service.get("/v1/runs", headers={"Authorization": f"Bearer {gone}"}).is_success
        with transaction(session_factory) as session:
            key = find_api_key(session, secret=gone)
            assert key is not None
            revoke_api_key(session, ref=key.id)

        for service in (client, replica):
            refused = service.get("/v1/runs/x", headers={"Authorization": f"Bearer {gone}"})
            assert refused.status_code == 401
            assert (
                service.post(
                    "/v1/runs/validate", json={}, headers={"Authorization": f"Bearer {gone}"}
                ).status_code
                == 401
            )
            assert service.get("/v1/runs", headers={"Authorization": f"Bearer {kept}"}).is_success

    def test_the_polling_routes_check_the_key_on_their_own_read(
        self,
        client: TestClient,
        replica: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
    ) -> None:
        """GET /v1/runs/{id} and the OpenAI retrieve check the key in the read itself
        (app/api/deps.py read_as_caller): the same rules as every other route."""
        secret = make_api_key(session_factory, name="poller")
        other = make_api_key(session_factory, name="someone-else")
        auth = {"Authorization": f"Bearer {secret}"}
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        polled = (f"/v1/runs/{run_id}", f"/v1/fine_tuning/jobs/{run_id}")
        for service in (client, replica):
            for path in polled:
                assert service.get(path, headers=auth).status_code == 200, path
                # Another key's run is not found; no key or a wrong one is refused.
                foreign = service.get(path, headers={"Authorization": f"Bearer {other}"})
                assert foreign.status_code == 404, path
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}):
                    refused = service.get(path, headers=headers)
                    assert refused.status_code == 401, (path, headers)
                    assert refused.headers["www-authenticate"].startswith("Bearer")

        with transaction(session_factory) as session:
            revoke_api_key(session, ref="poller")
        for service in (client, replica):
            for path in polled:
                refused = service.get(path, headers=auth)
                assert refused.status_code == 401, path
                error = refused.json()["error"]  # the OpenAI routes answer in OpenAI's shape
                assert (error if isinstance(error, str) else error["code"]) == "unauthorized"

    def test_a_revoked_key_is_not_found(self, session_factory: sessionmaker[Session]) -> None:
        secret = make_api_key(session_factory, name="old")
        with transaction(session_factory) as session:
            revoke_api_key(session, ref="old")
        with session_factory() as session:
            assert find_api_key(session, secret=secret) is None


class TestRevokeCommand:
    def test_an_unknown_key_exits_4(self, settings: Settings) -> None:
        env = {"TUNEYARD_DATABASE_URL": settings.resolved_database_url}
        result = CliRunner().invoke(cli, ["keys", "revoke", "key_nope"], env=env)
        assert result.exit_code == ExitCode.NOT_FOUND
        assert "key_nope" in result.stderr

    def test_a_name_shared_by_two_live_keys_is_refused_until_given_an_id(
        self, client: TestClient, settings: Settings, session_factory: sessionmaker[Session]
    ) -> None:
        first = make_api_key(session_factory, name="shared")
        second = make_api_key(session_factory, name="shared")
        env = {"TUNEYARD_DATABASE_URL": settings.resolved_database_url}
        result = CliRunner().invoke(cli, ["keys", "revoke", "shared"], env=env)
        assert result.exit_code == ExitCode.REFUSED
        assert "by id" in result.stderr
        for secret in (first, second):
            assert client.get("/v1/runs", headers={"Authorization": f"Bearer {secret}"}).is_success


@pytest.mark.parametrize(
    "url",
    [
        "/v1/runs?limit=0",
        "/v1/runs/run_x/metrics?limit=0",
        "/v1/runs/run_x/logs?tail=0",
        "/v1/runs/run_x/events?limit=0",
    ],
)
def test_no_key_is_refused_before_the_parameters_are_checked(replica: TestClient, url: str) -> None:
    """Without a key a client learns nothing, not even which parameter breaks a rule; the
    routes that check the key on their own read (read_as_caller) included."""
    answer = replica.get(url)
    assert answer.status_code == 401, answer.text
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")
