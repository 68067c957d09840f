"""Idempotency-Key, concurrent writers, metadata filters, and the auth switch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.settings import Settings
from app.storage.models import Run
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.factories import run_request


def _count_runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(Run)) or 0)


class TestIdempotencyKey:
    def test_same_key_and_body_returns_the_same_run(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        headers = {**auth, "Idempotency-Key": "nightly-2026-11-22"}
        first = client.post("/v1/runs", json=run_request(tmp_path), headers=headers)
        again = client.post("/v1/runs", json=run_request(tmp_path), headers=headers)
        assert first.status_code == 201
        assert again.status_code == 200
        assert again.json()["id"] == first.json()["id"]
        assert _count_runs(session_factory) == 1

    def test_same_key_with_another_body_is_409(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        headers = {**auth, "Idempotency-Key": "k1"}
        first = client.post("/v1/runs", json=run_request(tmp_path), headers=headers).json()
        other = run_request(tmp_path, training={"learning_rate": 5e-4})
        response = client.post("/v1/runs", json=other, headers=headers)
        assert response.status_code == 409
        assert first["id"] in response.json()["detail"]

    def test_defaults_written_out_count_as_the_same_body(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        headers = {**auth, "Idempotency-Key": "k2"}
        first = client.post("/v1/runs", json=run_request(tmp_path), headers=headers).json()
        explicit = run_request(tmp_path, task="causal_lm", training={"seed": 42})
        again = client.post("/v1/runs", json=explicit, headers=headers)
        assert again.status_code == 200
        assert again.json()["id"] == first["id"]

    def test_keys_are_per_principal(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        from tests.conftest import make_api_key

        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        a = client.post(
            "/v1/runs", json=run_request(tmp_path), headers={**auth, "Idempotency-Key": "same"}
        ).json()
        b = client.post(
            "/v1/runs", json=run_request(tmp_path), headers={**other, "Idempotency-Key": "same"}
        ).json()
        assert a["id"] != b["id"]

    def test_twenty_concurrent_posts_make_one_run_and_one_ray_job(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        headers = {**auth, "Idempotency-Key": "burst"}
        body = run_request(tmp_path)
        with ThreadPoolExecutor(max_workers=20) as pool:
            responses = list(
                pool.map(lambda _: client.post("/v1/runs", json=body, headers=headers), range(20))
            )

        assert sorted(r.status_code for r in responses) == [200] * 19 + [201]
        assert len({r.json()["id"] for r in responses}) == 1
        assert _count_runs(session_factory) == 1

        ray = dispatch_to(ScriptedRay(), settings, session_factory)
        assert len(ray.submitted) == 1


class TestConcurrentWriters:
    def test_fifty_concurrent_creates_all_succeed(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(tmp_path)
        with ThreadPoolExecutor(max_workers=50) as pool:
            responses = list(
                pool.map(lambda _: client.post("/v1/runs", json=body, headers=auth), range(50))
            )
        assert [r.status_code for r in responses] == [201] * 50, [
            r.text for r in responses if r.status_code != 201
        ][:3]
        assert _count_runs(session_factory) == 50


class TestMetadataFilter:
    def test_filters_by_metadata_pairs(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        made = {}
        for team, env in (("nlp", "prod"), ("nlp", "dev"), ("vision", "prod")):
            body = run_request(tmp_path, metadata={"team": team, "env": env})
            made[(team, env)] = client.post("/v1/runs", json=body, headers=auth).json()["id"]

        def ids(**params: str) -> set[str]:
            page = client.get("/v1/runs", params=params, headers=auth).json()
            return {r["id"] for r in page["data"]}

        assert ids(**{"metadata.team": "nlp"}) == {made[("nlp", "prod")], made[("nlp", "dev")]}
        assert ids(**{"metadata.team": "nlp", "metadata.env": "prod"}) == {made[("nlp", "prod")]}
        assert ids(**{"metadata.team": "robotics"}) == set()
        assert ids(**{"metadata.team": "vision", "status": "queued"}) == {made[("vision", "prod")]}


class TestAuthSwitch:
    def test_disabled_auth_is_refused_off_loopback(self, tmp_path: Path) -> None:
        with pytest.raises(ValidationError, match="only allowed when bound to a loopback"):
            Settings(home=tmp_path, auth="disabled", host="0.0.0.0")

    @pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
    def test_disabled_auth_is_accepted_on_loopback(self, tmp_path: Path, host: str) -> None:
        assert Settings(home=tmp_path, auth="disabled", host=host).auth == "disabled"

    def test_disabled_auth_serves_without_a_key(self, settings: Settings, tmp_path: Path) -> None:
        open_settings = settings.model_copy(update={"auth": "disabled"})
        with TestClient(create_app(open_settings, start_background=False)) as client:
            created = client.post("/v1/runs", json=run_request(tmp_path))
            assert created.status_code == 201, created.text
            assert client.get(f"/v1/runs/{created.json()['id']}").status_code == 200
