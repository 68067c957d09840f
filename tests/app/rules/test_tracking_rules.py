"""A request's `tracking` through the real API: refused with a 422 when the service cannot
serve the tracker, and, when accepted, what the run's job gets to reach it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.storage.models import Run
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.factories import run_request

MLFLOW_SERVER = "http://mlflow.internal:5000"


@pytest.fixture
def tracking_uri() -> str | None:
    return MLFLOW_SERVER


@pytest.fixture
def settings(
    tmp_path: Path, database_url: str, tiny_model_dir: Path, tracking_uri: str | None
) -> Settings:
    """The shared fixture's settings, with an MLflow server (tests that need none say so)."""
    home = tmp_path / "home"
    home.mkdir()
    return Settings(
        home=home,
        database_url=database_url,
        allowed_roots=f"{tmp_path}:{tiny_model_dir}",
        mlflow_tracking_uri=tracking_uri,
    )


@pytest.fixture(autouse=True)
def no_wandb_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _problems(response: Any) -> dict[str, str]:
    body = response.json()
    assert body["error"] == "validation_error"
    return {p["field"]: p["message"] for p in body["detail"]}


def _runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Run)) or 0


class TestTrackingRules:
    @pytest.mark.parametrize("tracking_uri", [None])
    def test_mlflow_needs_a_tracking_server(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(tmp_path, tracking={"mlflow": {}})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert "TUNEYARD_MLFLOW_TRACKING_URI" in _problems(response)["tracking.mlflow"]
        assert _runs(session_factory) == 0
        # /v1/runs/validate checks on a read session: the same answer.
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is False
        assert "tracking.mlflow" in {p["field"] for p in report["errors"]}

    @pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
    def test_a_tracker_needs_its_extra_installed(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        tracker: str,
    ) -> None:
        # What Python's import system does for a package that is not there: find_spec and
        # import both come up empty.
        monkeypatch.setitem(sys.modules, tracker, None)
        body = run_request(
            tmp_path, tracking={tracker: {"mode": "offline"} if tracker == "wandb" else {}}
        )
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert f"pip install 'tuneyard[{tracker}]'" in _problems(response)[f"tracking.{tracker}"]

    def test_wandb_online_needs_an_api_key_and_offline_does_not(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        online = run_request(tmp_path, tracking={"wandb": {"project": "p"}})
        response = client.post("/v1/runs", json=online, headers=auth)
        assert response.status_code == 422
        message = _problems(response)["tracking.wandb"]
        assert "WANDB_API_KEY" in message and "mode 'offline'" in message

        offline = run_request(tmp_path, tracking={"wandb": {"mode": "offline"}})
        assert client.post("/v1/runs", json=offline, headers=auth).status_code == 201
        monkeypatch.setenv("WANDB_API_KEY", "wandb-key-of-the-service")
        assert client.post("/v1/runs", json=online, headers=auth).status_code == 201


class TestTrackingJobEnv:
    def test_a_tracked_run_gets_the_server_and_credentials_and_no_other_run_does(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("WANDB_API_KEY", "wandb-key-of-the-service")
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "mlflow-token-of-the-service")
        tracked = run_request(
            tmp_path, tracking={"mlflow": {"experiment": "e"}, "wandb": {"project": "p"}}
        )
        plain = run_request(tmp_path)
        for body in (tracked, plain):
            assert client.post("/v1/runs", json=body, headers=auth).status_code == 201
        ray = dispatch_to(ScriptedRay(), settings, session_factory)
        envs = [job["runtime_env"]["env_vars"] for job in ray.submitted]
        assert len(envs) == 2
        with_tracking, without = sorted(envs, key=lambda env: "MLFLOW_TRACKING_URI" not in env)
        assert with_tracking["MLFLOW_TRACKING_URI"] == MLFLOW_SERVER
        assert with_tracking["MLFLOW_TRACKING_TOKEN"] == "mlflow-token-of-the-service"
        assert with_tracking["WANDB_API_KEY"] == "wandb-key-of-the-service"
        tracked_names = {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY"}
        assert not tracked_names & set(without)
