"""A run whose node died: the service starts another attempt from the latest checkpoint;
if what is left cannot hold that attempt, the run's error says a node was lost."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import post_status, worker_headers

LOSS = (
    "the cluster lost node 5d7029ca5561 at 10.0.0.2 during the run; training stopped because "
    "what was left could not hold or restart it: worker rank 1: ActorDiedError"
)
UNPLACEABLE = "the run asks for 2 workers x 1 CPU, but they fit 1 at most on the cluster's nodes"


def test_no_room_after_a_lost_node_fails_naming_the_node(
    client: TestClient,
    auth: dict[str, str],
    started: tuple[str, dict[str, str]],
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> None:
    run_id, worker = started
    post_status(client, run_id, worker, "running")
    lost = {"code": "cluster_error", "message": LOSS}
    post_status(client, run_id, worker, "failed", error=lost, check=True)
    run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
    assert (run["status"], run["attempt"]) == ("queued", 2)

    ray = dispatch_to(ScriptedRay(), settings, session_factory)
    unplaceable = {"code": "unplaceable", "message": UNPLACEABLE}
    second = worker_headers(ray)
    post_status(client, run_id, second, "failed", attempt=2, error=unplaceable, check=True)
    run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
    assert run["status"] == "failed" and run["error"]["code"] == "unplaceable"
    message = run["error"]["message"]
    assert message.startswith("lost: the cluster failed under attempt 1 (the cluster lost node")
    assert message.endswith(f"then attempt 2: {UNPLACEABLE}")


def test_an_unplaceable_first_attempt_reads_as_it_did(
    client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    run_id, worker = started
    unplaceable = {"code": "unplaceable", "message": UNPLACEABLE}
    post_status(client, run_id, worker, "failed", error=unplaceable, check=True)
    assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["error"]["message"] == (
        UNPLACEABLE
    )
