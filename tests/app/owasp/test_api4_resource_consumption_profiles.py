"""OWASP API4 Unrestricted Resource Consumption: profiles (`POST /v1/runs/validate` with
`profile: true`).

A profile trains a few steps of the request on the cluster, in a Ray job as large as the
run, at once: it does not wait in the queue. It checked only the key's max_priority and
max_gpus, so a key at its max_queued_runs still got `valid: true` and a job; nothing capped
how many ran at once, so N parallel validates made N jobs of up to 900 s each; and after a
crash nothing stopped the `profile-*` jobs a service had been waiting for or deleted their
files. These tests try each: a key at each of its limits asks for a profile (429 naming the
rule, no job); a key asks for a second profile while its first runs, and another key asks
while the service runs its most (429 each, one job in all); and a service started again
after a crash reaps what its last run left, but not another replica's profile under way.

Ray is the scripted stand-in of the profile tests, playing the profile's job.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import JobState
from app.main import create_app
from app.services import profiles
from app.settings import Settings
from contract.job_env import PROFILE_ENV
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.test_profiles import ProfilingRay
from tests.app.test_shared_queue import new_key
from tests.factories import run_request

Headers = dict[str, str]


@pytest.fixture(autouse=True)
def quick_ray_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's job manager looks at a job every second; this Ray's never writes behind."""
    monkeypatch.setattr(profiles, "RAY_MONITOR_PERIOD_S", 0.01)


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    """No run here trains: tests/conftest.py's settings without its tiny model. A profile
    that is never answered ends in seconds, not 900."""
    home = tmp_path / "home"
    home.mkdir()
    return Settings(
        home=home, database_url=database_url, allowed_roots=str(tmp_path), profile_timeout_s=10
    )


@pytest.fixture
def ray(settings: Settings) -> ProfilingRay:
    return ProfilingRay(settings.storage)


@pytest.fixture
def client(settings: Settings, ray: ProfilingRay) -> Iterator[TestClient]:
    app = create_app(settings, start_background=False)
    with TestClient(app) as test_client:
        app.state.tuneyard.jobs = ray
        yield test_client


def profile_body(root: Path, **overrides: Any) -> dict[str, Any]:
    return {**run_request(root, **overrides), "profile": True, "profile_steps": 4}


def validate(client: TestClient, key: Headers, body: dict[str, Any]) -> Any:
    return client.post("/v1/runs/validate", json=body, headers=key)


def refused(response: Any) -> str:
    assert response.status_code == 429, response.text
    assert response.json()["error"] == "too_many_requests"
    return str(response.json()["detail"])


class TestTheKeysLimits:
    @pytest.mark.parametrize("rule", ["max_queued_runs", "max_running_runs", "max_gpus"])
    def test_a_key_at_a_limit_gets_no_profile(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        tmp_path: Path,
        ray: ProfilingRay,
        rule: str,
    ) -> None:
        gpus = {"num_workers": 1, "use_gpu": True}
        key = new_key(session_factory, "team", **{rule: 1})
        created = client.post("/v1/runs", json=run_request(tmp_path, resources=gpus), headers=key)
        assert created.status_code == 201, created.text
        if rule != "max_queued_runs":
            # Its run holds the cluster now (its job on another scripted Ray).
            dispatch_to(ScriptedRay(), settings, session_factory)

        body = profile_body(tmp_path, resources=gpus)
        detail = refused(validate(client, key, body))
        assert f"its {rule}" in detail, detail
        assert ray.submitted == []

        # Without the profile, the same request validates: it is the profile that waits.
        plain = validate(client, key, {**body, "profile": False})
        assert plain.status_code == 200 and plain.json()["valid"] is True


class TestProfilesAtOnce:
    @pytest.fixture
    def client(self, settings: Settings, ray: ProfilingRay) -> Iterator[TestClient]:
        """A service that runs one profile at a time."""
        app = create_app(
            settings.model_copy(update={"max_concurrent_profiles": 1}), start_background=False
        )
        with TestClient(app) as test_client:
            app.state.tuneyard.jobs = ray
            yield test_client

    def test_one_per_key_and_the_services_most_in_all(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        ray: ProfilingRay,
    ) -> None:
        a = new_key(session_factory, "team-a")
        b = new_key(session_factory, "team-b")
        ray.final = None  # the profile runs until told otherwise
        first: dict[str, Any] = {}
        running = threading.Thread(
            target=lambda: first.update(answer=validate(client, a, profile_body(tmp_path)))
        )
        running.start()
        deadline = time.monotonic() + 10
        while not ray.submitted and time.monotonic() < deadline:
            time.sleep(0.02)
        [job] = ray.submitted

        again = refused(validate(client, a, profile_body(tmp_path)))
        assert "a key runs one at a time" in again
        other = refused(validate(client, b, profile_body(tmp_path)))
        assert "TUNEYARD_MAX_CONCURRENT_PROFILES" in other
        assert len(ray.submitted) == 1

        # The first ends; its slot is free again for whoever asks next.
        ray.states[job["submission_id"]] = JobState(status="SUCCEEDED", message="done")
        running.join(15)
        assert first["answer"].status_code == 200
        assert first["answer"].json()["profile"]["error"] is None
        ray.final = "SUCCEEDED"
        answer = validate(client, b, profile_body(tmp_path))
        assert answer.status_code == 200, answer.text
        assert len(ray.submitted) == 2


class TestReapedAtStartUp:
    def orphan(
        self,
        ray: ProfilingRay,
        settings: Settings,
        profile_id: str,
        *,
        ago_s: float,
        **metadata: str,
    ) -> None:
        """A profile job as a service submits one, `ago_s` ago, still running, with the
        result and the Ray Train folder it writes."""
        result = profiles.result_location(settings.storage, profile_id)
        ray.submit(
            submission_id=profile_id,
            entrypoint=profiles.ENTRYPOINT,
            runtime_env={"env_vars": {PROFILE_ENV: json.dumps({"result": result})}},
            metadata={**profiles.job_metadata(settings), **metadata},
        )
        ray.submitted[-1]["submitted_at"] -= ago_s

    def left(self, settings: Settings, profile_id: str) -> list[bool]:
        storage = settings.storage
        return [
            storage.exists(profiles.result_location(storage, profile_id)),
            storage.exists(storage.join(profile_id)),
        ]

    def test_what_a_crash_left_is_stopped_and_deleted_and_nothing_else(
        self, settings: Settings, ray: ProfilingRay
    ) -> None:
        Path(settings.storage.root).mkdir(parents=True)
        ray.final = None
        other = {profiles.INSTANCE_KEY: "another-replica:8000"}
        # This service's, before it crashed moments ago (within any wait: 10 s here).
        self.orphan(ray, settings, "profile-crashed", ago_s=5)
        # Another replica's, an hour past any wait: its service is gone too.
        self.orphan(ray, settings, "profile-abandoned", ago_s=3600, **other)
        # Another replica's profile under way, and another service's (other storage).
        self.orphan(ray, settings, "profile-sibling", ago_s=5, **other)
        elsewhere = {profiles.STORAGE_KEY: "/elsewhere/storage"}
        self.orphan(ray, settings, "profile-elsewhere", ago_s=3600, **elsewhere)
        # Files of a profile whose job Ray forgot (the service died between the two).
        self.orphan(ray, settings, "profile-forgotten", ago_s=5)
        ray.states["profile-forgotten"] = None

        jobs: Any = ray
        reaper = profiles.ProfileReaper(
            settings=settings, jobs=jobs, slots=profiles.ProfileSlots(1)
        )
        reaper.tick()

        assert sorted(ray.stopped) == ["profile-abandoned", "profile-crashed"]
        assert sorted(ray.deleted) == ["profile-abandoned", "profile-crashed"]
        for gone in ("profile-crashed", "profile-abandoned", "profile-forgotten"):
            assert self.left(settings, gone) == [False, False], gone
        assert self.left(settings, "profile-sibling") == [True, True]
        assert ray.state("profile-sibling") == JobState(status="RUNNING", message="")

    def test_the_services_own_profile_under_way_is_left_alone(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        tmp_path: Path,
        ray: ProfilingRay,
    ) -> None:
        ray.final = None
        key = new_key(session_factory, "team")
        slots = client.app.state.tuneyard.profile_slots  # type: ignore[attr-defined]
        jobs: Any = ray
        reaper = profiles.ProfileReaper(settings=settings, jobs=jobs, slots=slots)
        reaper.started_at += 60  # as if the service had started after this profile
        answered: dict[str, Any] = {}
        running = threading.Thread(
            target=lambda: answered.update(answer=validate(client, key, profile_body(tmp_path)))
        )
        running.start()
        deadline = time.monotonic() + 10
        while not ray.submitted and time.monotonic() < deadline:
            time.sleep(0.02)
        [job] = ray.submitted

        assert reaper.tick() == []
        assert ray.stopped == []
        ray.states[job["submission_id"]] = JobState(status="SUCCEEDED", message="done")
        running.join(15)
        assert answered["answer"].json()["profile"]["error"] is None
