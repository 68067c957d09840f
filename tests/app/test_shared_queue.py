"""The shared queue through the HTTP API and the dispatcher, on a real database.

Ray is the scripted stand-in from the dispatch tests, whose `free` plays the dashboard's
report of each node's free resources; workers are played by posting to the real callback
endpoints with the token the dispatcher gave the job, as the worker does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import JobState, UsageNotReported
from app.services.api_keys import create_api_key
from app.services.dispatch import Dispatcher
from app.services.placement import ClusterView
from app.services.queue import LIVE
from app.services.scheduling import Ask
from app.settings import Settings
from app.storage.db import make_engine, make_session_factory, transaction
from app.storage.models import Event, Run, utcnow
from tests.app.test_dispatch import ScriptedRay
from tests.app.worker_calls import control, post_status, worker_headers
from tests.factories import run_request

Headers = dict[str, str]


def new_key(session_factory: sessionmaker[Session], name: str, **limits: int | None) -> Headers:
    """An API key with these limits; the headers its caller sends."""
    with transaction(session_factory) as session:
        _, secret = create_api_key(session, name=name, limits=limits)
    return {"Authorization": f"Bearer {secret}"}


def body(
    root: Path, *, priority: int = 50, gpus: int = 0, workers: int = 1, preemptible: bool = True
) -> dict[str, Any]:
    """A valid request for `workers` workers of `gpus` GPUs each (CPU-only when 0)."""
    resources: dict[str, Any] = {"num_workers": workers}
    if gpus:
        resources |= {"use_gpu": True, "gpus_per_worker": gpus}
    return run_request(root, priority=priority, preemptible=preemptible, resources=resources)


def submit(client: TestClient, headers: Headers, root: Path, **request: Any) -> str:
    response = client.post("/v1/runs", json=body(root, **request), headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def stored(session_factory: sessionmaker[Session], run_id: str) -> Run:
    with session_factory() as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run


def count_runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Run)) or 0


def backdate(session_factory: sessionmaker[Session], run_id: str, **columns: timedelta) -> None:
    """Set time columns of a run to that long ago: the clock the scheduler reads."""
    with transaction(session_factory) as session:
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values({name: utcnow() - ago for name, ago in columns.items()})
        )


def events(session_factory: sessionmaker[Session], run_id: str) -> list[Event]:
    with session_factory() as session:
        return list(session.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)))


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    """tests/conftest.py's settings without its tiny model: no run here trains."""
    home = tmp_path / "home"
    home.mkdir()
    return Settings(home=home, database_url=database_url, allowed_roots=str(tmp_path))


@pytest.fixture
def ray() -> ScriptedRay:
    return ScriptedRay()


def dispatcher_for(
    settings: Settings,
    session_factory: sessionmaker[Session],
    ray: ScriptedRay,
    cluster: ClusterView | None = None,
    **changes: Any,
) -> Dispatcher:
    """A dispatcher whose global cap is out of the way unless a test sets it: these tests
    are about the scheduler's other limits. `cluster`: validation's view of the nodes."""
    tuned = settings.model_copy(update={"max_concurrent_runs": 100, **changes})
    jobs: Any = ray
    return Dispatcher(settings=tuned, session_factory=session_factory, jobs=jobs, cluster=cluster)


@pytest.fixture
def dispatcher(
    settings: Settings, session_factory: sessionmaker[Session], ray: ScriptedRay
) -> Dispatcher:
    return dispatcher_for(settings, session_factory, ray)


class TestSubmissionLimits:
    def test_a_priority_above_max_priority_is_422_naming_priority_and_the_limit(
        self, client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
    ) -> None:
        key = new_key(session_factory, "interns", max_priority=60)
        response = client.post("/v1/runs", json=body(tmp_path, priority=70), headers=key)
        assert response.status_code == 422
        (problem,) = response.json()["detail"]
        assert problem["field"] == "priority"
        assert "priority 70 is above this API key's max_priority (60)" in problem["message"]
        assert count_runs(session_factory) == 0

        report = client.post("/v1/runs/validate", json=body(tmp_path, priority=70), headers=key)
        assert report.json()["valid"] is False
        assert [e["field"] for e in report.json()["errors"]] == ["priority"]

        assert client.post("/v1/runs", json=body(tmp_path, priority=60), headers=key).is_success

    def test_a_run_that_names_no_priority_gets_the_default_capped_at_max_priority(
        self, client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
    ) -> None:
        # Below the default of 50: without the cap, such a key could only submit by naming
        # a priority, which OpenAI's clients cannot (nor the validate report below).
        key = new_key(session_factory, "batch", max_priority=30)
        request = body(tmp_path)
        del request["priority"]
        assert client.post("/v1/runs/validate", json=request, headers=key).json()["valid"]
        created = client.post("/v1/runs", json=request, headers=key)
        assert created.status_code == 201, created.text
        assert stored(session_factory, created.json()["id"]).priority == 30
        unlimited = new_key(session_factory, "on-call")
        created = client.post("/v1/runs", json=request, headers=unlimited)
        assert stored(session_factory, created.json()["id"]).priority == 50

    def test_more_gpus_than_max_gpus_is_422(
        self, client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
    ) -> None:
        key = new_key(session_factory, "small-team", max_gpus=2)
        response = client.post("/v1/runs", json=body(tmp_path, gpus=1, workers=4), headers=key)
        assert response.status_code == 422
        (problem,) = response.json()["detail"]
        assert "asks for 4 GPUs, more than this API key's max_gpus (2)" in problem["message"]
        assert count_runs(session_factory) == 0
        submit(client, key, tmp_path, gpus=1, workers=2)

    def test_one_over_max_queued_runs_is_429_and_nothing_is_stored(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
    ) -> None:
        key = new_key(session_factory, "sweeper", max_queued_runs=2)
        first = submit(client, key, tmp_path)
        submit(client, key, tmp_path)
        response = client.post("/v1/runs", json=body(tmp_path), headers=key)
        assert response.status_code == 429
        answer = response.json()
        assert answer["error"] == "too_many_requests"
        assert answer["detail"] == (
            "this API key has 2 runs queued, its max_queued_runs is 2: wait until some start, "
            "or cancel some"
        )
        assert count_runs(session_factory) == 2

        # Another key is not limited by this one's queue.
        submit(client, new_key(session_factory, "other"), tmp_path)
        # A run that started no longer counts: there is room again.
        assert dispatcher.dispatch_queued_runs() >= 1
        assert stored(session_factory, first).status == "starting"
        submit(client, key, tmp_path)

    def test_an_idempotent_retry_at_the_limit_returns_the_earlier_run(
        self, client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
    ) -> None:
        key = new_key(session_factory, "ci", max_queued_runs=1)
        retry = {**key, "Idempotency-Key": "nightly-42"}
        first = client.post("/v1/runs", json=body(tmp_path), headers=retry)
        assert first.status_code == 201
        again = client.post("/v1/runs", json=body(tmp_path), headers=retry)
        assert again.status_code == 200
        assert again.json()["id"] == first.json()["id"]
        assert client.post("/v1/runs", json=body(tmp_path), headers=key).status_code == 429
        assert count_runs(session_factory) == 1

    def test_resume_counts_max_queued_runs_too(
        self, client: TestClient, session_factory: sessionmaker[Session], tmp_path: Path
    ) -> None:
        key = new_key(session_factory, "resumer", max_queued_runs=1)
        old = submit(client, key, tmp_path)
        assert client.post(f"/v1/runs/{old}/cancel", headers=key).json()["status"] == "cancelled"
        waiting = submit(client, key, tmp_path)

        refused = client.post(f"/v1/runs/{old}/resume", headers=key)
        assert refused.status_code == 429
        assert "max_queued_runs is 1" in refused.json()["detail"]
        assert stored(session_factory, old).status == "cancelled"

        client.post(f"/v1/runs/{waiting}/cancel", headers=key)
        resumed = client.post(f"/v1/runs/{old}/resume", headers=key)
        assert resumed.status_code == 200, resumed.text
        assert (resumed.json()["status"], resumed.json()["attempt"]) == ("queued", 2)


class TestQueueView:
    def test_the_queued_listing_is_the_schedulers_order_with_position_and_reason(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        a = new_key(session_factory, "team-a")
        b = new_key(session_factory, "team-b")
        a1, a2, a3 = (submit(client, a, tmp_path, gpus=1) for _ in range(3))
        b1 = submit(client, b, tmp_path, gpus=1)
        urgent = submit(client, b, tmp_path, priority=90, gpus=1, workers=4)
        ray.free = [{"CPU": 8.0, "GPU": 2.0}]
        assert dispatcher.dispatch_queued_runs() == 0

        # The urgent run first; then fair share: a has nothing taken, then a (1 GPU taken)
        # before b (the urgent run's 4), then b before a's third. Positions are the whole
        # queue's; each key lists its own runs.
        # b's urgent run, as a's runs are told of it: never by its id.
        behind = "behind higher priority (another key's run, priority 90, is waiting for "
        behind += "cluster resources)"
        listed_a = client.get("/v1/runs", params={"status": "queued"}, headers=a).json()["data"]
        assert [(r["id"], r["queue"]) for r in listed_a] == [
            (a1, {"position": 2, "reason": behind}),
            (a2, {"position": 3, "reason": behind}),
            (a3, {"position": 5, "reason": behind}),
        ]
        listed_b = client.get("/v1/runs", params={"status": "queued"}, headers=b).json()["data"]
        assert [(r["id"], r["queue"]["position"]) for r in listed_b] == [(urgent, 1), (b1, 4)]
        assert listed_b[0]["queue"]["reason"] == (
            "waiting for cluster resources (needs 4 GPUs + 4 CPUs, 2 GPUs + 8 CPUs free)"
        )
        one = client.get(f"/v1/runs/{a3}", headers=a).json()
        assert one["queue"] == {"position": 5, "reason": behind}
        assert one["queue_position"] == 5

        # Without the urgent run, what fits starts: one run of each key, by fair share.
        client.post(f"/v1/runs/{urgent}/cancel", headers=b)
        assert dispatcher.dispatch_queued_runs() == 2
        assert sorted(j["submission_id"] for j in ray.submitted) == sorted([f"{a1}-1", f"{b1}-1"])
        listed_a = client.get("/v1/runs", params={"status": "queued"}, headers=a).json()["data"]
        full = "waiting for cluster resources (needs 1 GPU + 1 CPU, 0 GPUs + 6 CPUs free)"
        assert [(r["id"], r["queue"]) for r in listed_a] == [
            (a2, {"position": 1, "reason": full}),
            (a3, {"position": 2, "reason": full}),
        ]
        started = client.get(f"/v1/runs/{a1}", headers=a).json()
        assert (started["status"], started["queue"]) == ("starting", None)

    def test_a_key_at_max_running_runs_waits_while_another_keys_run_starts(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        a = new_key(session_factory, "team-a", max_running_runs=1)
        b = new_key(session_factory, "team-b")
        a1, a2 = submit(client, a, tmp_path), submit(client, a, tmp_path)
        b1 = submit(client, b, tmp_path)
        assert dispatcher.dispatch_queued_runs() == 2

        assert [stored(session_factory, r).status for r in (a1, a2, b1)] == [
            "starting",
            "queued",
            "starting",
        ]
        waiting = client.get(f"/v1/runs/{a2}", headers=a).json()["queue"]
        assert waiting == {
            "position": 1,
            "reason": "waiting for quota (1 of 1 running, max_running_runs)",
        }

        # Once a's run ends, its next one starts.
        ray.states[f"{a1}-1"] = JobState(status="SUCCEEDED", message="")
        dispatcher.reconcile_live_runs()
        assert dispatcher.dispatch_queued_runs() == 1
        assert stored(session_factory, a2).status == "starting"

    def test_a_key_at_max_gpus_waits_with_the_reason(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
    ) -> None:
        a = new_key(session_factory, "team-a", max_gpus=3)
        first = submit(client, a, tmp_path, gpus=2)
        second = submit(client, a, tmp_path, gpus=2)
        assert dispatcher.dispatch_queued_runs() == 1
        assert stored(session_factory, first).status == "starting"
        assert client.get(f"/v1/runs/{second}", headers=a).json()["queue"]["reason"] == (
            "waiting for quota (needs 2 GPUs, 2 of 3 in use, max_gpus)"
        )


class TestNeverFits:
    """A queued run the cluster's nodes can no longer ever hold (a node left for good)."""

    def test_it_fails_as_unplaceable_once_that_has_held_for_the_grace(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        ray: ScriptedRay,
        tmp_path: Path,
    ) -> None:
        key = new_key(session_factory, "team")
        nodes = [{"CPU": 1.0}]  # one node of one CPU left; the run asks for 2 workers
        cluster = ClusterView(lambda: nodes, autoscales=False)
        run_id = submit(client, key, tmp_path, workers=2)
        ray.free = [{"CPU": 1.0}]
        dispatcher = dispatcher_for(
            settings, session_factory, ray, cluster, unplaceable_grace_s=0.3
        )
        dispatcher.dispatch_queued_runs()
        # Within the grace it waits, saying why: a node may be rejoining after a head restart.
        waiting = stored(session_factory, run_id)
        assert waiting.status == "queued"
        assert waiting.queue_reason == (
            "no node can hold it: the run asks for 2 workers x 1 CPU, but they fit 1 at most "
            "on the cluster's nodes (1 CPU); change the request or add nodes (it fails if none "
            "that can joins within 0.3 s, TUNEYARD_UNPLACEABLE_GRACE_S)"
        )

        time.sleep(0.4)
        dispatcher.dispatch_queued_runs()
        failed = stored(session_factory, run_id)
        assert failed.status == "failed" and failed.error_code == "unplaceable"
        assert failed.error_message == (
            "the run asks for 2 workers x 1 CPU, but they fit 1 at most on the cluster's "
            "nodes (1 CPU); change the request or add nodes"
        )
        assert ray.submitted == []

    def test_one_that_fits_again_within_the_grace_is_not_failed(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        ray: ScriptedRay,
        tmp_path: Path,
    ) -> None:
        key = new_key(session_factory, "team")
        nodes = [{"CPU": 1.0}]
        cluster = ClusterView(lambda: list(nodes), autoscales=False, ttl_s=0)
        run_id = submit(client, key, tmp_path, workers=2)
        ray.free = [{"CPU": 1.0}]
        dispatcher = dispatcher_for(
            settings, session_factory, ray, cluster, unplaceable_grace_s=0.3
        )
        dispatcher.dispatch_queued_runs()
        nodes.append({"CPU": 1.0})  # the second node is back
        # Awaited, not slept on: the view reads in the background, and a read the first pass
        # started may still hold the one node (it did on a busy machine).
        deadline = time.monotonic() + 60
        while len(cluster.nodes() or []) < 2:
            assert time.monotonic() < deadline, "the view never saw the second node"
            time.sleep(0.01)
        time.sleep(0.4)  # past the grace: only the node's return keeps the run from failing
        ray.free = [{"CPU": 1.0}, {"CPU": 1.0}]
        dispatcher.dispatch_queued_runs()
        assert stored(session_factory, run_id).status == "starting"

    def test_a_gpu_run_accepted_before_the_nodes_were_known_says_why_and_fails_in_a_minute(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        ray: ScriptedRay,
        tmp_path: Path,
    ) -> None:
        """Issue 39: posted in a service's first seconds, before its view of a CPU-only
        cluster was read, a GPU run was accepted (this client has no view, as then) and sat
        queued with no reason for the 600 s placement timeout, holding back every run of
        lower priority. It now says why at the first pass that knows the nodes, keeps no one
        back, and fails within a minute (the default settings, on the dispatcher's clock)."""
        key = new_key(session_factory, "team")
        gpu_run = submit(client, key, tmp_path, priority=90, gpus=1, workers=1)
        cpu_run = submit(client, key, tmp_path, workers=1)
        ray.free = [{"CPU": 8.0}]
        now = [1000.0]
        jobs: Any = ray
        dispatcher = Dispatcher(
            settings=settings,
            session_factory=session_factory,
            jobs=jobs,
            cluster=ClusterView(lambda: [{"CPU": 8.0}], autoscales=False),
            clock=lambda: now[0],
        )
        dispatcher.dispatch_queued_runs()
        waiting = stored(session_factory, gpu_run)
        assert waiting.status == "queued"
        assert waiting.queue_reason == (
            "no node can hold it: the run asks for 1 worker x 1 GPU + 1 CPU, but the cluster "
            "has no GPUs; change the request or add nodes (it fails if none that can joins "
            "within 60 s, TUNEYARD_UNPLACEABLE_GRACE_S)"
        )
        assert stored(session_factory, cpu_run).status == "starting"

        now[0] += 59
        dispatcher.dispatch_queued_runs()
        assert stored(session_factory, gpu_run).status == "queued"
        now[0] += 2
        dispatcher.dispatch_queued_runs()
        failed = stored(session_factory, gpu_run)
        assert (failed.status, failed.error_code) == ("failed", "unplaceable")
        assert "the cluster has no GPUs" in (failed.error_message or "")
        assert [job["submission_id"] for job in ray.submitted] == [f"{cpu_run}-1"]

    def test_an_autoscaling_cluster_is_asked_for_the_nodes_not_judged_by_those_it_has(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        ray: ScriptedRay,
        tmp_path: Path,
    ) -> None:
        """The same GPU run on a CPU-only cluster that autoscales: Ray's autoscaler adds a
        GPU node only when a job asks for one, so the run goes to Ray at once; no pass, at
        any time, says no node can hold it or fails it."""
        key = new_key(session_factory, "team")
        gpu_run = submit(client, key, tmp_path, priority=90, gpus=1, workers=1)
        ray.free = [{"CPU": 8.0}]
        now = [1000.0]
        jobs: Any = ray
        dispatcher = Dispatcher(
            settings=settings.model_copy(update={"cluster_autoscales": True}),
            session_factory=session_factory,
            jobs=jobs,
            cluster=ClusterView(lambda: [{"CPU": 8.0}], autoscales=True),
            clock=lambda: now[0],
        )
        dispatcher.dispatch_queued_runs()
        now[0] += 61
        dispatcher.dispatch_queued_runs()
        started = stored(session_factory, gpu_run)
        assert (started.status, started.error_code) == ("starting", None)
        assert not (started.queue_reason or "").startswith("no node can hold it")
        assert [job["submission_id"] for job in ray.submitted] == [f"{gpu_run}-1"]


class TestWithoutRaysReport:
    def test_the_nodes_totals_less_the_live_runs_stand_in(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        ray: ScriptedRay,
        tmp_path: Path,
    ) -> None:
        """A head's first seconds: the dashboard answers, its monitor has not reported what
        is taken yet. Dispatching everything then would leave the runs waiting inside Ray."""
        key = new_key(session_factory, "team")
        cluster = ClusterView(lambda: [{"CPU": 2.0}], autoscales=False)
        dispatcher = dispatcher_for(settings, session_factory, ray, cluster)
        assert ray.free is None  # the scripted Ray reports nothing
        first = submit(client, key, tmp_path, workers=1)
        second = submit(client, key, tmp_path, workers=1)
        third = submit(client, key, tmp_path, workers=1)
        # The 2 CPUs hold two one-worker runs; the third waits, counted against the totals.
        assert dispatcher.dispatch_queued_runs() == 2
        assert {stored(session_factory, r).status for r in (first, second)} == {"starting"}
        waiting = stored(session_factory, third)
        assert waiting.status == "queued"
        assert waiting.queue_reason == "waiting for cluster resources (needs 1 CPU, 0 CPUs free)"

    def test_a_head_without_any_report_yet_holds_the_queue_a_while_not_for_good(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        settings: Settings,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        class StartingHead(ScriptedRay):
            def free_resources(self) -> list[dict[str, float]]:
                raise UsageNotReported("the dashboard reports no node's usage yet")

        ray = StartingHead()
        key = new_key(session_factory, "team")
        run_id = submit(client, key, tmp_path)
        # No node registered yet either.
        dispatcher = dispatcher_for(
            settings,
            session_factory,
            ray,
            ClusterView(lambda: [], autoscales=False, first_read_wait_s=0),
        )
        assert dispatcher.dispatch_queued_runs() == 0
        assert stored(session_factory, run_id).status == "queued"
        # A monitor that never reports (failing) must not hold the queue for good.
        monkeypatch.setattr("app.services.dispatch.USAGE_WAIT_S", 0.0)
        assert dispatcher.dispatch_queued_runs() == 1


class TestPreemption:
    """A high-priority run that cannot be placed has a lower-priority preemptible run
    checkpoint and go back to the queue."""

    @pytest.fixture
    def sweeps_key(self, session_factory: sessionmaker[Session]) -> Headers:
        return new_key(session_factory, "sweeps")

    @pytest.fixture
    def low(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        sweeps_key: Headers,
    ) -> str:
        """A preemptible priority-10 run holding the cluster's 2 GPUs, running for an hour
        (past the minimum run time), at step 3."""
        key = sweeps_key
        ray.free = [{"CPU": 8.0, "GPU": 2.0}]
        run_id = submit(client, key, tmp_path, priority=10, gpus=2)
        assert dispatcher.dispatch_queued_runs() == 1
        worker = worker_headers(ray, run_id)
        now = datetime.now(UTC).isoformat()
        for path, posted in (
            ("status", {"status": "running"}),
            (
                "metrics",
                {
                    "points": [
                        {"step": s, "name": "loss", "value": 1.0, "time": now} for s in (1, 2, 3)
                    ],
                    "progress": {"step": 3},
                },
            ),
        ):
            r = client.post(
                f"/v1/internal/runs/{run_id}/{path}", json={"attempt": 1, **posted}, headers=worker
            )
            assert r.status_code == 200, r.text
        backdate(session_factory, run_id, attempt_started_at=timedelta(hours=1))
        ray.free = [{"CPU": 7.0, "GPU": 0.0}]  # what the low run left
        return run_id

    @pytest.fixture
    def urgent_key(self, session_factory: sessionmaker[Session]) -> Headers:
        return new_key(session_factory, "on-call")

    def preempt(
        self,
        client: TestClient,
        urgent_key: Headers,
        tmp_path: Path,
        dispatcher: Dispatcher,
    ) -> str:
        """Submit the urgent run and let the dispatcher decide; the urgent run's id."""
        urgent = submit(client, urgent_key, tmp_path, priority=90, gpus=2)
        assert dispatcher.dispatch_queued_runs() == 0
        return urgent

    def test_preempted_checkpoints_requeues_and_resumes_after_the_urgent_run(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        low: str,
        sweeps_key: Headers,
        urgent_key: Headers,
    ) -> None:
        worker = worker_headers(ray, low)
        assert control(client, low, worker).json() == {"preempt": False}

        urgent = self.preempt(client, urgent_key, tmp_path, dispatcher)
        # Two keys' runs: each is told of the other's without its id.
        why = "another key's run (priority 90) needs its resources"
        assert client.get(f"/v1/runs/{urgent}", headers=urgent_key).json()["queue"]["reason"] == (
            "waiting for cluster resources (needs 2 GPUs + 1 CPU, 0 GPUs + 7 CPUs free); "
            "preempting another key's run"
        )
        assert control(client, low, worker).json() == {"preempt": True, "reason": why}
        # A status of its own in the lifecycle, until the worker stops; a client sees it.
        assert stored(session_factory, low).status == "preempting"
        assert client.get(f"/v1/runs/{low}", headers=sweeps_key).json()["status"] == "preempting"
        # The request is made once: a second pass, the run still stopping, does not repeat it.
        dispatcher.dispatch_queued_runs()
        requested = [e for e in events(session_factory, low) if "preemption requested" in e.message]
        assert [(e.type, e.status) for e in requested] == [("status", "preempting")]

        # The worker saved its checkpoint at step 3 and says so.
        said = client.post(
            f"/v1/internal/runs/{low}/events",
            json={"attempt": 1, "type": "preempted", "message": "checkpoint saved at step 3"},
            headers=worker,
        )
        assert said.status_code == 200, said.text
        run = stored(session_factory, low)
        assert (run.status, run.attempt, run.resubmits) == ("queued", 2, 0)
        assert run.queue_reason == f"preempted (resumes from step 3): {why}"
        assert [e.message for e in events(session_factory, low) if e.type == "preempted"] == [
            f"preempted at step 3: {why}"
        ]
        assert control(client, low, worker).status_code == 401  # attempt 1 is over

        # Its GPUs are back: the urgent run starts, the preempted one waits behind it and
        # does not preempt it in turn.
        ray.free = [{"CPU": 8.0, "GPU": 2.0}]
        assert dispatcher.dispatch_queued_runs() == 1
        assert stored(session_factory, urgent).status == "starting"
        assert stored(session_factory, urgent).preempt_requested_at is None
        # Still saying it was preempted, and why it waits now.
        assert stored(session_factory, low).queue_reason == (
            "preempted (resumes from step 3): waiting for cluster resources (needs 2 GPUs + "
            "1 CPU, 0 GPUs + 7 CPUs free)"
        )

        ray.states[f"{urgent}-1"] = JobState(status="SUCCEEDED", message="")
        dispatcher.reconcile_live_runs()
        assert dispatcher.dispatch_queued_runs() == 1
        assert ray.submitted[-1]["submission_id"] == f"{low}-2"

    def test_not_before_the_minimum_run_time(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        low: str,
        urgent_key: Headers,
    ) -> None:
        # The low run's attempt began a minute ago; TUNEYARD_PREEMPTION_MIN_RUN_S is 600.
        backdate(session_factory, low, attempt_started_at=timedelta(minutes=1))
        urgent = self.preempt(client, urgent_key, tmp_path, dispatcher)
        assert control(client, low, worker_headers(ray, low)).json() == {"preempt": False}
        assert client.get(f"/v1/runs/{urgent}", headers=urgent_key).json()["queue"]["reason"] == (
            "waiting for cluster resources (needs 2 GPUs + 1 CPU, 0 GPUs + 7 CPUs free)"
        )

    @pytest.fixture
    def asked(
        self,
        client: TestClient,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        low: str,
        urgent_key: Headers,
    ) -> Preempting:
        """The urgent run submitted and decided on: the low run is asked to stop."""
        self.preempt(client, urgent_key, tmp_path, dispatcher)
        return Preempting(client, session_factory, dispatcher, ray, low)

    @pytest.mark.parametrize("ray_says", ["STOPPED", "SUCCEEDED", "FAILED"])
    def test_a_job_that_ends_while_preempting_is_requeued(
        self, asked: Preempting, ray_says: str
    ) -> None:
        # The worker's `preempted` was lost; Ray says the job ended.
        asked.ray_says(ray_says)
        run = asked.run()
        assert (run.status, run.attempt, run.resubmits, run.error_code) == ("queued", 2, 0, None)
        assert run.queue_reason is not None and run.queue_reason.startswith("preempted (")
        assert asked.event_types().count("preempted") == 1

    def test_a_job_that_trained_its_last_step_while_asked_succeeds(self, asked: Preempting) -> None:
        # The last step is never preempted: the run finished and exported, and its own
        # "succeeded" was lost. Requeued, it would start again only to export again.
        asked.worker_progress(step=5, total_steps=5)
        asked.ray_says("SUCCEEDED")
        assert (asked.run().status, asked.run().attempt) == ("succeeded", 1)
        assert "preempted" not in asked.event_types()

    def test_a_worker_that_does_not_stop_within_the_grace_is_stopped(
        self, asked: Preempting
    ) -> None:
        asked.dispatcher.reconcile_live_runs()
        assert asked.ray.stopped == []  # it has its grace period to checkpoint

        grace = asked.dispatcher.settings.preemption_grace_s
        backdate(
            asked.session_factory, asked.low, preempt_requested_at=timedelta(seconds=grace + 60)
        )
        asked.dispatcher.reconcile_live_runs()
        assert asked.ray.stopped == [f"{asked.low}-1"]
        events_said = [e.message for e in events(asked.session_factory, asked.low)]
        assert any("preemption grace period" in message for message in events_said)

        asked.ray_says("STOPPED")
        assert (asked.run().status, asked.run().attempt) == ("queued", 2)

    @pytest.mark.parametrize("ray_says", ["STOPPED", "SUCCEEDED"])
    def test_cancelling_a_preempting_run_still_cancels_it(
        self, asked: Preempting, sweeps_key: Headers, ray_says: str
    ) -> None:
        # STOPPED: the cancel stopped the job. SUCCEEDED: the worker had already stopped at
        # its checkpoint, and the entry point exited 0 before the stop reached it.
        client, low = asked.client, asked.low
        cancelled = client.post(f"/v1/runs/{low}/cancel", headers=sweeps_key)
        assert cancelled.json()["status"] == "cancelling"
        assert control(client, low, asked.worker()).json() == {"preempt": False}

        # The worker stops as the preemption asked; the run does not go back to the queue.
        asked.worker_stopped()
        assert asked.run().status == "cancelling"
        asked.ray_says(ray_says)
        assert (asked.run().status, asked.run().attempt) == ("cancelled", 1)
        assert "preempted" not in asked.event_types()

    def test_an_error_of_the_training_code_while_preempting_fails_the_run(
        self, asked: Preempting
    ) -> None:
        # The next attempt would meet the same error: it is the run's failure, not a
        # preemption that no budget counts.
        error = {
            "code": "training_error",
            "message": "worker rank 1: IndexError: index out of range in self",
        }
        post_status(asked.client, asked.low, asked.worker(), "failed", error=error, check=True)
        run = asked.run()
        assert (run.status, run.attempt, run.error_code) == ("failed", 1, "training_error")

    def test_the_old_jobs_end_does_not_decide_the_requeued_attempt(self, asked: Preempting) -> None:
        """The reconciler reads the live runs, then asks Ray about each job: the worker's
        `preempted` can requeue the run in between, and the old job's end then arrives."""
        ray_state = asked.ray.state

        def state_after_the_worker_stopped(submission_id: str) -> JobState | None:
            if submission_id == f"{asked.low}-1":
                asked.worker_stopped()
                return JobState(status="FAILED", message="the job's workers were stopped")
            return ray_state(submission_id)

        asked.ray.state = state_after_the_worker_stopped  # type: ignore[method-assign]
        asked.dispatcher.reconcile_live_runs()
        run = asked.run()
        assert (run.status, run.attempt, run.error_code) == ("queued", 2, None)


@dataclass
class Preempting:
    """The low run of TestPreemption asked to checkpoint and stop, and what drives it."""

    client: TestClient
    session_factory: sessionmaker[Session]
    dispatcher: Dispatcher
    ray: ScriptedRay
    low: str

    def run(self) -> Run:
        return stored(self.session_factory, self.low)

    def worker(self) -> Headers:
        return worker_headers(self.ray, self.low)

    def event_types(self) -> list[str]:
        return [e.type for e in events(self.session_factory, self.low)]

    def worker_stopped(self) -> None:
        """The worker saved its checkpoint at step 3 and says so, as it does."""
        said = self.client.post(
            f"/v1/internal/runs/{self.low}/events",
            json={"attempt": 1, "type": "preempted", "message": "checkpoint saved at step 3"},
            headers=self.worker(),
        )
        assert said.status_code == 200, said.text

    def worker_progress(self, *, step: int, total_steps: int) -> None:
        said = self.client.post(
            f"/v1/internal/runs/{self.low}/metrics",
            json={
                "attempt": 1,
                "points": [],
                "progress": {"step": step, "total_steps": total_steps},
            },
            headers=self.worker(),
        )
        assert said.status_code == 200, said.text

    def ray_says(self, status: str) -> None:
        """Ray's view of the attempt's job, as the reconciler next reads it."""
        self.ray.states[f"{self.low}-1"] = JobState(status=status, message="")
        self.dispatcher.reconcile_live_runs()


class TestReplicas:
    """Two service replicas dispatch from one database: its lock, not either process's
    memory, keeps the limits."""

    def test_two_dispatchers_never_start_more_than_the_limits(
        self,
        client: TestClient,
        settings: Settings,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        slots, per_key = 4, 2
        a = new_key(session_factory, "sweeps", max_running_runs=per_key)
        b = new_key(session_factory, "team-b")
        # A run that stays live throughout (one slot taken), so that each pass reads live
        # runs before it reads the queue.
        forever = submit(client, new_key(session_factory, "service"), tmp_path)
        dispatcher_for(
            settings, session_factory, ray, max_concurrent_runs=slots
        ).dispatch_queued_runs()
        assert stored(session_factory, forever).status == "starting"
        sweep = [submit(client, a, tmp_path) for _ in range(10)]
        others = [submit(client, b, tmp_path) for _ in range(3)]

        # One replica pauses between reading the live runs and reading the queue, while
        # the other runs a whole pass: without the scheduler's lock, the paused one would
        # decide from live runs that are no longer all there are.
        paused = threading.Event()
        pause_once = {"due": False}
        of_spec = Ask.of_spec.__func__  # type: ignore[attr-defined]

        def slow_of_spec(cls: type[Ask], spec: dict[str, Any]) -> Ask:
            if threading.current_thread().name == "slow-replica" and pause_once["due"]:
                pause_once["due"] = False
                paused.set()
                time.sleep(0.3)
            return of_spec(cls, spec)

        monkeypatch.setattr(Ask, "of_spec", classmethod(slow_of_spec))
        engines = [make_engine(settings.resolved_database_url) for _ in range(2)]
        replicas = [
            dispatcher_for(settings, make_session_factory(e), ray, max_concurrent_runs=slots)
            for e in engines
        ]
        try:
            for _ in range(8):
                waiting_a, waiting_b = (
                    self._queued(session_factory, sweep),
                    self._queued(session_factory, others),
                )
                if not waiting_a + waiting_b:
                    break
                pause_once["due"] = True
                paused.clear()
                slow = threading.Thread(
                    target=replicas[0].dispatch_queued_runs, name="slow-replica"
                )
                fast = threading.Thread(
                    target=replicas[1].dispatch_queued_runs, name="fast-replica"
                )
                slow.start()
                assert paused.wait(10)
                fast.start()
                slow.join(30)
                fast.join(30)

                with session_factory() as session:
                    live = set(session.scalars(select(Run.id).where(Run.status.in_(LIVE))))
                live_a, live_b = live & set(sweep), live & set(others)
                assert len(live) <= slots and len(live_a) <= per_key
                # Not one run fewer either: fair share takes a, b, a into the free slots.
                started_a = min(per_key, waiting_a)
                assert (len(live_a), len(live_b)) == (
                    started_a,
                    min(slots - 1 - started_a, waiting_b),
                )
                submitted = [j["submission_id"] for j in ray.submitted]
                assert len(submitted) == len(set(submitted))  # each run went to Ray once

                for run_id in live_a | live_b:
                    ray.states[f"{run_id}-1"] = JobState(status="SUCCEEDED", message="")
                replicas[0].reconcile_live_runs()
        finally:
            for engine in engines:
                engine.dispose()
        assert {stored(session_factory, r).status for r in sweep + others} == {"succeeded"}

    @staticmethod
    def _queued(session_factory: sessionmaker[Session], ids: list[str]) -> int:
        with session_factory() as session:
            return (
                session.scalar(select(func.count()).where(Run.id.in_(ids), Run.status == "queued"))
                or 0
            )
