"""A run whose node died: the service starts another attempt from the latest checkpoint;
if what is left cannot hold that attempt, the run's error says a node was lost."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay, dispatch_to

LOSS = (
    "the cluster lost node 5d7029ca5561 at 10.0.0.2 during the run; training stopped because "
    "what was left could not hold or restart it: worker rank 1: ActorDiedError"
)
UNPLACEABLE = "the run asks for 2 workers x 1 CPU, but they fit 1 at most on the cluster's nodes"


def _post_status(
    client: TestClient, run_id: str, token: str, attempt: int, code: str, message: str
) -> None:
    r = client.post(
        f"/v1/internal/runs/{run_id}/status",
        json={"attempt": attempt, "status": "failed", "error": {"code": code, "message": message}},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200, r.text


def test_no_room_after_a_lost_node_fails_naming_the_node(
    client: TestClient,
    auth: dict[str, str],
    started: tuple[str, dict[str, str]],
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> None:
    run_id, worker = started
    token = worker["Authorization"].removeprefix("Bearer ")
    client.post(
        f"/v1/internal/runs/{run_id}/status",
        json={"attempt": 1, "status": "running"},
        headers=worker,
    )
    _post_status(client, run_id, token, 1, "cluster_error", LOSS)
    run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
    assert (run["status"], run["attempt"]) == ("queued", 2)

    ray = dispatch_to(ScriptedRay(), settings, session_factory)
    second = ray.submitted[-1]["runtime_env"]["env_vars"]["TUNEYARD_RUN_TOKEN"]
    _post_status(client, run_id, second, 2, "unplaceable", UNPLACEABLE)
    run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
    assert run["status"] == "failed" and run["error"]["code"] == "unplaceable"
    message = run["error"]["message"]
    assert message.startswith("lost: the cluster failed under attempt 1 (the cluster lost node")
    assert message.endswith(f"then attempt 2: {UNPLACEABLE}")


def test_an_unplaceable_first_attempt_reads_as_it_did(
    client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    run_id, worker = started
    token = worker["Authorization"].removeprefix("Bearer ")
    _post_status(client, run_id, token, 1, "unplaceable", UNPLACEABLE)
    assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["error"]["message"] == (
        UNPLACEABLE
    )
