"""A diverging run's metrics (NaN, ±Infinity): stored, served as null plus a flag, and
reported by the worker's own client without losing a point, on a real database.

JSON has no NaN or Infinity, and neither SQLite's REAL nor a JSON column holds them:
before, a NaN loss made every callback that carried it a 500, and the worker's metrics
thread died on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.settings import Settings
from tests.app.conftest import HTTP_TIMEOUT_S, served, start_run
from tests.app.worker_calls import run_location
from tests.conftest import make_api_key
from worker.reporting.service_client import MetricsSender, ServiceClient

NAN, INF = float("nan"), float("inf")


def _point(step: int, name: str, value: Any) -> dict[str, Any]:
    return {"step": step, "name": name, "value": value, "time": datetime.now(UTC).isoformat()}


def _served(points: list[dict[str, Any]]) -> list[tuple[int, str, Any, Any]]:
    return [(p["step"], p["name"], p["value"], p["nonfinite"]) for p in points]


class TestCallbacksTakeNonFiniteValues:
    """What a worker posts, as strict JSON strings or as the bare tokens Python writes."""

    @pytest.mark.parametrize("bare_tokens", [False, True], ids=["json-strings", "bare-tokens"])
    def test_metric_points_are_served_as_null_with_a_flag(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        bare_tokens: bool,
    ) -> None:
        run_id, token = start_run(client, auth, tmp_path, settings, session_factory)
        worker = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        nan, inf, ninf = (NAN, INF, -INF) if bare_tokens else ("NaN", "Infinity", "-Infinity")
        points = [
            _point(1, "loss", 2.5),
            _point(2, "loss", nan),
            _point(2, "grad_norm", inf),
            _point(2, "delta", ninf),
            _point(2, "step_time_seconds", 0.5),
        ]
        body = {"attempt": 1, "points": points, "progress": {"step": 2, "total_steps": 4}}
        content = json.dumps(body, allow_nan=bare_tokens)
        r = client.post(f"/v1/internal/runs/{run_id}/metrics", content=content, headers=worker)
        assert r.status_code == 200, r.text
        assert r.json() == {"stored": 5}

        data = client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        assert _served(data) == [
            (1, "loss", 2.5, None),
            (2, "delta", None, "-inf"),
            (2, "grad_norm", None, "inf"),
            (2, "loss", None, "nan"),
            (2, "step_time_seconds", 0.5, None),
        ]
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["latest_metrics"] == {
            "loss": None,
            "grad_norm": None,
            "delta": None,
            "step_time_seconds": 0.5,
        }
        assert run["nonfinite_metrics"] == {"loss": "nan", "grad_norm": "inf", "delta": "-inf"}
        # The run list shows the same view.
        listed = client.get("/v1/runs", headers=auth).json()["data"]
        assert listed[0]["nonfinite_metrics"] == run["nonfinite_metrics"]

    def test_a_finite_value_after_a_nan_clears_its_flag(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        for step, value in ((1, "NaN"), (2, 1.25)):
            body = {"attempt": 1, "points": [_point(step, "loss", value)]}
            r = client.post(f"/v1/internal/runs/{run_id}/metrics", json=body, headers=worker)
            assert r.status_code == 200, r.text
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["latest_metrics"] == {"loss": 1.25}
        assert run["nonfinite_metrics"] == {}

    def test_checkpoint_metrics(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        body = {
            "attempt": 1,
            "step": 5,
            "path": run_location(settings, run_id, "checkpoint_5"),
            "kind": "deepspeed",
            "metrics": {"loss": "NaN", "grad_norm": "Infinity", "learning_rate": 0.001},
        }
        r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
        assert r.status_code == 200, r.text

        (checkpoint,) = client.get(f"/v1/runs/{run_id}/checkpoints", headers=auth).json()["data"]
        assert checkpoint["metrics"] == {"loss": None, "grad_norm": None, "learning_rate": 0.001}
        assert checkpoint["nonfinite_metrics"] == {"loss": "nan", "grad_norm": "inf"}

    def test_the_event_stream_serves_them_too(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        base = f"/v1/internal/runs/{run_id}"
        client.post(f"{base}/status", json={"attempt": 1, "status": "running"}, headers=worker)
        points = [_point(1, "loss", "NaN"), _point(1, "lr", 0.1)]
        r = client.post(f"{base}/metrics", json={"attempt": 1, "points": points}, headers=worker)
        assert r.status_code == 200, r.text
        client.post(f"{base}/status", json={"attempt": 1, "status": "succeeded"}, headers=worker)

        with client.stream("GET", f"/v1/runs/{run_id}/events/stream", headers=auth) as stream:
            text = "".join(stream.iter_text())
        metrics = [
            json.loads(block.split("data: ", 1)[1])
            for block in text.replace("\r\n", "\n").split("\n\n")
            if "event: metric" in block
        ]
        assert [(m["name"], m["value"], m["nonfinite"]) for m in metrics] == [
            ("loss", None, "nan"),
            ("lr", 0.1, None),
        ]

    def test_a_nonfinite_epoch_is_refused_by_name(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        body = {"attempt": 1, "points": [], "progress": {"step": 1, "epoch": "NaN"}}
        r = client.post(f"/v1/internal/runs/{run_id}/metrics", json=body, headers=worker)
        assert r.status_code == 422
        assert [p["field"] for p in r.json()["detail"]] == ["progress.epoch"]


@dataclass
class LiveService:
    url: str
    api: httpx.Client
    run_id: str
    token: str

    def metrics(self) -> list[tuple[int, str, Any, Any]]:
        return _served(self.api.get(f"/v1/runs/{self.run_id}/metrics").json()["data"])

    def run(self) -> dict[str, Any]:
        result: dict[str, Any] = self.api.get(f"/v1/runs/{self.run_id}").json()
        return result


@pytest.fixture
def live(
    settings: Settings, session_factory: sessionmaker[Session], tmp_path: Path
) -> Iterator[LiveService]:
    """The service on a loopback port (uvicorn in a thread), with one started run."""
    key = make_api_key(session_factory)
    with (
        served(create_app(settings, start_background=False)) as url,
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=HTTP_TIMEOUT_S
        ) as api,
    ):
        with TestClient(create_app(settings, start_background=False)) as local:
            run_id, token = start_run(
                local, {"Authorization": f"Bearer {key}"}, tmp_path, settings, session_factory
            )
        yield LiveService(url=url, api=api, run_id=run_id, token=token)


@pytest.fixture
def reporter(live: LiveService) -> Iterator[tuple[ServiceClient, MetricsSender]]:
    client = ServiceClient(base_url=live.url, token=live.token, run_id=live.run_id, attempt=1)
    sender = MetricsSender(client, flush_interval_s=0.05)
    yield client, sender
    sender.close(timeout_s=2)
    client.close()


class TestTheWorkerReportsADivergingRun:
    """worker/reporting/service_client.py against the real service."""

    def test_every_point_arrives_and_flush_says_so(
        self, live: LiveService, reporter: tuple[ServiceClient, MetricsSender]
    ) -> None:
        client, sender = reporter
        assert client.status("running")
        losses = [2.0, 1.5, NAN, INF, -INF, 1.0]
        for step, loss in enumerate(losses, start=1):
            sender.log({"loss": loss}, step=step, progress={"step": step, "total_steps": 6})

        assert sender.flush(timeout_s=10) is True

        assert live.metrics() == [
            (1, "loss", 2.0, None),
            (2, "loss", 1.5, None),
            (3, "loss", None, "nan"),
            (4, "loss", None, "inf"),
            (5, "loss", None, "-inf"),
            (6, "loss", 1.0, None),
        ]
        run = live.run()
        assert run["status"] == "running"
        assert run["progress"]["step"] == 6

    def test_the_metrics_thread_keeps_sending_after_a_nan(
        self, live: LiveService, reporter: tuple[ServiceClient, MetricsSender]
    ) -> None:
        """No flush: the background thread alone delivers what follows the NaN."""
        _, sender = reporter
        sender.log({"loss": NAN}, step=1, progress={"step": 1})
        time.sleep(0.3)
        sender.log({"loss": 0.5}, step=2, progress={"step": 2})

        deadline = time.monotonic() + 10
        while len(live.metrics()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.metrics() == [(1, "loss", None, "nan"), (2, "loss", 0.5, None)]
        assert live.run()["latest_metrics"] == {"loss": 0.5}

    def test_checkpoint_metrics_with_a_nan_are_recorded(
        self,
        live: LiveService,
        reporter: tuple[ServiceClient, MetricsSender],
        settings: Settings,
    ) -> None:
        client, _ = reporter
        path = run_location(settings, live.run_id, "ckpt_3")
        assert client.checkpoint(
            step=3, epoch=0.5, path=path, kind="deepspeed", metrics={"loss": NAN}
        )
        (checkpoint,) = live.api.get(f"/v1/runs/{live.run_id}/checkpoints").json()["data"]
        assert checkpoint["metrics"] == {"loss": None}
        assert checkpoint["nonfinite_metrics"] == {"loss": "nan"}

    def test_flush_says_so_when_the_service_refused_points(
        self, live: LiveService, reporter: tuple[ServiceClient, MetricsSender]
    ) -> None:
        """The run ended: the service refuses the attempt's token, and the points are lost."""
        client, sender = reporter
        assert client.status("running")
        assert client.status("succeeded")
        sender.log({"loss": 1.0}, step=1, progress={"step": 1})

        assert sender.flush(timeout_s=5) is False
        assert live.metrics() == []
        # Reported once: the next flush has nothing lost to report.
        assert sender.flush(timeout_s=5) is True
