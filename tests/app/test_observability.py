"""Prometheus `/metrics` and structured logs, on a real database with the scripted Ray."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import RayUnavailable
from app.logs import configure_logging
from app.services.dispatch import Dispatcher
from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay
from tests.app.worker_calls import post_status, worker_headers
from tests.factories import run_request


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` as {(sample name, sorted labels): value}, fetched without an API key."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def runs_in(samples: dict[Any, float], status: str) -> float:
    return samples[("tuneyard_runs", (("status", status),))]


@pytest.fixture
def dispatcher(client: TestClient, settings: Settings) -> tuple[Dispatcher, ScriptedRay]:
    """The app's own metrics, fed by a dispatcher over the scripted Ray."""
    ray = ScriptedRay()
    jobs: Any = ray
    client.app.state.tuneyard.jobs = jobs  # type: ignore[attr-defined]
    state = client.app.state.tuneyard  # type: ignore[attr-defined]
    return (
        Dispatcher(
            settings=settings,
            session_factory=state.database.session_factory,
            jobs=jobs,
            metrics=state.metrics,
        ),
        ray,
    )


class TestPrometheus:
    def test_runs_by_status_and_dispatch_metrics(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        dispatcher: tuple[Dispatcher, ScriptedRay],
    ) -> None:
        before = scrape(client)
        assert runs_in(before, "queued") == 0
        assert runs_in(before, "succeeded") == 0  # every status is reported, even at 0

        for _ in range(3):
            assert client.post("/v1/runs", json=run_request(tmp_path), headers=auth).is_success
        assert runs_in(scrape(client), "queued") == 3

        disp, ray = dispatcher
        disp.tick()
        after = scrape(client)
        assert runs_in(after, "queued") == 0
        assert runs_in(after, "starting") == 3
        assert after[("tuneyard_dispatch_latency_seconds_count", ())] == 3
        assert after[("tuneyard_ray_submit_duration_seconds_count", ())] == 3
        assert after[("tuneyard_reconcile_duration_seconds_count", ())] == 1
        assert len(ray.submitted) == 3

    def test_a_refused_submit_is_not_a_dispatch(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        dispatcher: tuple[Dispatcher, ScriptedRay],
    ) -> None:
        client.post("/v1/runs", json=run_request(tmp_path), headers=auth)
        disp, ray = dispatcher
        ray.fail_with = RayUnavailable("connection refused")
        assert disp.dispatch_queued_runs() == 0
        samples = scrape(client)
        assert samples.get(("tuneyard_dispatch_latency_seconds_count", ()), 0) == 0
        assert runs_in(samples, "queued") == 1

    def test_callback_ingest_counters(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        dispatcher: tuple[Dispatcher, ScriptedRay],
    ) -> None:
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        disp, ray = dispatcher
        disp.dispatch_queued_runs()
        worker = worker_headers(ray, run_id)
        now = datetime.now(UTC).isoformat()
        points = [{"step": s, "name": "loss", "value": 1.0, "time": now} for s in range(5)]
        post_status(client, run_id, worker, "running")
        for _ in range(2):  # a retried batch
            r = client.post(
                f"/v1/internal/runs/{run_id}/metrics",
                json={"attempt": 1, "points": points},
                headers=worker,
            )
            assert r.status_code == 200
        samples = scrape(client)
        assert samples[("tuneyard_metric_points_received_total", ())] == 10
        stored = client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        assert len(stored) == 5
        assert samples[("tuneyard_callbacks_total", (("kind", "metrics"),))] == 2
        assert samples[("tuneyard_callbacks_total", (("kind", "status"),))] == 1
        assert runs_in(samples, "running") == 1

    def test_two_apps_do_not_share_counters(self, settings: Settings) -> None:
        from app.main import create_app

        first = create_app(settings, start_background=False)
        second = create_app(settings, start_background=False)
        first.state.tuneyard.metrics.metric_points.inc(7)
        assert second.state.tuneyard.metrics.registry is not first.state.tuneyard.metrics.registry
        assert second.state.tuneyard.metrics.metric_points._value.get() == 0


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The service's logging set up as `serve` does (JSON), captured."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging(fmt="json", level="INFO")
    stream = io.StringIO()
    root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    yield stream
    root.handlers[:], _ = saved
    root.setLevel(saved[1])


def records(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line]


class TestStructuredLogs:
    def test_status_changes_carry_the_run_id(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        json_log: io.StringIO,
    ) -> None:
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
        lines = [r for r in records(json_log) if r["logger"] == "tuneyard"]
        assert any(
            r["run_id"] == run_id and "cancelled" in r["message"] and r["level"] == "INFO"
            for r in lines
        ), lines
        assert all({"time", "level", "logger", "message", "run_id"} <= r.keys() for r in lines)

    def test_a_log_line_inside_a_run_request_gets_the_run_id_from_the_path(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        json_log: io.StringIO,
        dispatcher: tuple[Dispatcher, ScriptedRay],
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()["id"]
        disp, ray = dispatcher
        disp.dispatch_queued_runs()

        def unreachable(submission_id: str) -> None:
            raise RayUnavailable("connection refused")

        ray.stop = unreachable  # type: ignore[method-assign]
        assert client.post(f"/v1/runs/{run_id}/cancel", headers=auth).status_code == 200
        warning = [r for r in records(json_log) if "could not reach Ray" in r["message"]]
        # The warning's call site names no run; the request's path does.
        assert warning and warning[0]["run_id"] == run_id

    def test_text_format_appends_the_run_id(self) -> None:
        root = logging.getLogger()
        saved = root.handlers[:], root.level
        try:
            configure_logging(fmt="text", level="INFO")
            stream = io.StringIO()
            root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
            logging.getLogger("tuneyard").info("hello", extra={"run_id": "run_abc"})
            logging.getLogger("tuneyard").info("no run")
        finally:
            root.handlers[:], _ = saved
            root.setLevel(saved[1])
        first, second = stream.getvalue().splitlines()
        assert first.endswith("hello run_id=run_abc")
        assert second.endswith("no run")

    def test_no_request_url_reaches_the_log(self, tmp_path: Path) -> None:
        """httpx logs every request's URL at INFO; the service's own requests include its
        tenants' webhook URLs, whose path or query may hold a token (issue 39's attack)."""
        import httpx

        root = logging.getLogger()
        saved = root.handlers[:], root.level, logging.getLogger("httpx").level
        try:
            configure_logging(fmt="text", level="INFO")
            stream = io.StringIO()
            root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
            transport = httpx.MockTransport(lambda request: httpx.Response(200))
            with httpx.Client(transport=transport) as http:
                http.post("https://hooks.example.test/ok?token=SECRET_A1")
            logging.getLogger("tuneyard").info("still logging")
        finally:
            root.handlers[:], _, httpx_level = saved
            root.setLevel(saved[1])
            logging.getLogger("httpx").setLevel(httpx_level)
        assert "SECRET_A1" not in stream.getvalue()
        assert "still logging" in stream.getvalue()
