"""OWASP API3 Broken Object Property Level Authorization: the shared queue's reasons.

Every key shares one queue, and the scheduler says why each run waits and why a run is
preempted. Those words named the other run by its id: key B's queued run read "behind
higher priority (run run_…, priority 90, …)", naming key A's run, and B's preempted run
was told (in its events, its queue reason, the control answer its worker logs) that "run
run_… (priority 90) needs its resources". A run id is what another tenant's storage paths
are built from (issue 39, item 3). These tests have key A's run hold back and preempt key
B's, and read everything B is shown: the queue reason, the run's events, the worker's
control answer, and A's reason for B's stopped run. Another key's run is described by its
priority only; a key's own runs may still be named. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.services.dispatch import Dispatcher
from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay
from tests.app.test_shared_queue import backdate, dispatcher_for, new_key, submit
from tests.app.worker_calls import control, worker_headers

Headers = dict[str, str]


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    """No run here trains: tests/conftest.py's settings without its tiny model."""
    home = tmp_path / "home"
    home.mkdir()
    return Settings(home=home, database_url=database_url, allowed_roots=str(tmp_path))


@pytest.fixture
def ray() -> ScriptedRay:
    return ScriptedRay()


@pytest.fixture
def dispatcher(
    settings: Settings, session_factory: sessionmaker[Session], ray: ScriptedRay
) -> Dispatcher:
    return dispatcher_for(settings, session_factory, ray)


@pytest.fixture
def key_a(session_factory: sessionmaker[Session]) -> Headers:
    return new_key(session_factory, "team-a")


@pytest.fixture
def key_b(session_factory: sessionmaker[Session]) -> Headers:
    return new_key(session_factory, "team-b")


def reason(client: TestClient, key: Headers, run_id: str) -> str:
    view = client.get(f"/v1/runs/{run_id}", headers=key).json()
    assert view["status"] == "queued", view
    return str(view["queue"]["reason"])


def everything_shown(client: TestClient, key: Headers, run_id: str) -> str:
    """The run's view, its events and the key's queued listing, as one text."""
    parts = [
        client.get(f"/v1/runs/{run_id}", headers=key).text,
        client.get(f"/v1/runs/{run_id}/events", headers=key).text,
        client.get("/v1/runs", params={"status": "queued"}, headers=key).text,
    ]
    return "\n".join(parts)


class TestBehindHigherPriority:
    def test_another_keys_blocking_run_is_described_without_its_id(
        self,
        client: TestClient,
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        key_a: Headers,
        key_b: Headers,
    ) -> None:
        urgent = submit(client, key_a, tmp_path, priority=90, gpus=1, workers=4)
        a_waiting = submit(client, key_a, tmp_path, gpus=1)
        b_waiting = submit(client, key_b, tmp_path, gpus=1)
        ray.free = [{"CPU": 8.0, "GPU": 2.0}]
        assert dispatcher.dispatch_queued_runs() == 0

        assert reason(client, key_b, b_waiting) == (
            "behind higher priority (another key's run, priority 90, is waiting for cluster "
            "resources)"
        )
        assert urgent not in everything_shown(client, key_b, b_waiting)
        # Behind the same run, its own key is told which it is.
        assert reason(client, key_a, a_waiting) == (
            f"behind higher priority (run {urgent}, priority 90, is waiting for cluster resources)"
        )


class TestPreemption:
    @pytest.fixture
    def low(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        key_b: Headers,
    ) -> str:
        """Key B's preemptible run holding the cluster's 2 GPUs, running for an hour."""
        ray.free = [{"CPU": 8.0, "GPU": 2.0}]
        run_id = submit(client, key_b, tmp_path, priority=10, gpus=2)
        assert dispatcher.dispatch_queued_runs() == 1
        worker = worker_headers(ray, run_id)
        now = datetime.now(UTC).isoformat()
        for path, posted in (
            ("status", {"status": "running"}),
            (
                "metrics",
                {
                    "points": [{"step": 3, "name": "loss", "value": 1.0, "time": now}],
                    "progress": {"step": 3},
                },
            ),
        ):
            r = client.post(
                f"/v1/internal/runs/{run_id}/{path}", json={"attempt": 1, **posted}, headers=worker
            )
            assert r.status_code == 200, r.text
        backdate(session_factory, run_id, attempt_started_at=timedelta(hours=1))
        ray.free = [{"CPU": 7.0, "GPU": 0.0}]  # what B's run left
        return run_id

    def test_the_preempted_key_is_not_told_the_preempting_runs_id(
        self,
        client: TestClient,
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        key_a: Headers,
        key_b: Headers,
        low: str,
    ) -> None:
        urgent = submit(client, key_a, tmp_path, priority=90, gpus=2)
        assert dispatcher.dispatch_queued_runs() == 0

        # A is told its run preempts one, not which.
        a_reason = reason(client, key_a, urgent)
        assert a_reason.endswith("; preempting another key's run"), a_reason
        assert low not in everything_shown(client, key_a, urgent)

        # B's worker is asked to stop (and logs why, in B's job log), without A's run id.
        worker = worker_headers(ray, low)
        asked = control(client, low, worker).json()
        assert asked == {
            "preempt": True,
            "reason": "another key's run (priority 90) needs its resources",
        }
        said = client.post(
            f"/v1/internal/runs/{low}/events",
            json={"attempt": 1, "type": "preempted", "message": "checkpoint saved at step 3"},
            headers=worker,
        )
        assert said.status_code == 200, said.text

        # Back in the queue: its reason and its events say why, without A's run id.
        assert reason(client, key_b, low) == (
            "preempted (resumes from step 3): another key's run (priority 90) needs its resources"
        )
        shown = everything_shown(client, key_b, low)
        assert "preemption requested: another key's run (priority 90)" in shown
        assert urgent not in shown
