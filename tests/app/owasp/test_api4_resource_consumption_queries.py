"""API4 Unrestricted Resource Consumption: query parameters, cursors and callback numbers.

Every value a client controls that reaches a query is checked before it does: a number
past what its column holds (INTEGER: 2^31 - 1, BIGINT ids: 2^63 - 1), a cursor nested to
exhaust the JSON decoder, a NUL that PostgreSQL text cannot hold. Each is a 422 naming
the field, on SQLite and PostgreSQL alike; before, each was a 500 on one or both.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from tests.app.conftest import start_run

INT32_PAST = 2**31
INT64_PAST = 2**63


def refused_fields(response: Any) -> list[str]:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "validation_error"
    return [problem["field"] for problem in body["detail"]]


def _point(**overrides: Any) -> dict[str, Any]:
    point = {"step": 1, "name": "loss", "value": 1.0, "time": datetime.now(UTC).isoformat()}
    return {**point, **overrides}


class TestNumbersPastTheColumns:
    def test_events_after(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, _ = started
        url = f"/v1/runs/{run_id}/events"
        r = client.get(url, params={"after": INT64_PAST}, headers=auth)
        assert refused_fields(r) == ["after"]
        # Event ids are BIGINT: an id past 2^31 is a real one, not a mistake.
        assert client.get(url, params={"after": INT32_PAST}, headers=auth).status_code == 200

    def test_metrics_after_step(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, _ = started
        r = client.get(
            f"/v1/runs/{run_id}/metrics", params={"after_step": INT32_PAST}, headers=auth
        )
        assert refused_fields(r) == ["after_step"]

    @pytest.mark.parametrize(
        "cursor", [f"{INT32_PAST}:1:loss", f"1:{INT32_PAST}:loss", "-1:1:loss", "1_0:1:loss"]
    )
    def test_metrics_cursor(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        cursor: str,
    ) -> None:
        run_id, _ = started
        r = client.get(f"/v1/runs/{run_id}/metrics", params={"cursor": cursor}, headers=auth)
        assert refused_fields(r) == ["cursor"]

    @pytest.mark.parametrize("last_event_id", [f"{INT64_PAST}:0", f"0:{INT64_PAST}", "1_0:0"])
    def test_stream_last_event_id(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        last_event_id: str,
    ) -> None:
        run_id, _ = started
        r = client.get(
            f"/v1/runs/{run_id}/events/stream",
            headers={**auth, "Last-Event-ID": last_event_id},
        )
        assert refused_fields(r) == ["Last-Event-ID"]

    @pytest.mark.parametrize(
        ("route", "body", "field"),
        [
            ("metrics", {"points": [_point(step=INT32_PAST)]}, "points.0.step"),
            ("metrics", {"points": [], "progress": {"step": INT32_PAST}}, "progress.step"),
            (
                "metrics",
                {"points": [], "progress": {"step": 1, "total_steps": INT32_PAST}},
                "progress.total_steps",
            ),
            ("checkpoints", {"step": INT32_PAST, "path": "/c", "kind": "hf"}, "step"),
            ("status", {"status": "running", "attempt": INT32_PAST}, "attempt"),
        ],
    )
    def test_callback_numbers(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        route: str,
        body: dict[str, Any],
        field: str,
    ) -> None:
        run_id, worker = started
        r = client.post(
            f"/v1/internal/runs/{run_id}/{route}", json={"attempt": 1, **body}, headers=worker
        )
        assert refused_fields(r) == [field]
        # Nothing half-stored: the run is as it was.
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert (run["status"], run["progress"]["step"]) == ("starting", 0)

    def test_the_largest_numbers_the_columns_hold_are_taken(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        last = INT32_PAST - 1
        body = {"attempt": 1, "points": [_point(step=last)], "progress": {"step": last}}
        r = client.post(f"/v1/internal/runs/{run_id}/metrics", json=body, headers=worker)
        assert r.status_code == 200, r.text
        metrics = client.get(
            f"/v1/runs/{run_id}/metrics", params={"after_step": last - 1}, headers=auth
        ).json()
        assert [m["step"] for m in metrics["data"]] == [last]


class TestHostileCursors:
    def test_a_deeply_nested_runs_cursor(self, client: TestClient, auth: dict[str, str]) -> None:
        """JSON nested past the decoder's recursion limit (a RecursionError, a 500, before)."""
        nested = base64.urlsafe_b64encode(b"[" * 40_000).decode()
        r = client.get("/v1/runs", params={"cursor": nested}, headers=auth)
        assert refused_fields(r) == ["cursor"]

    def test_a_runs_cursor_that_is_not_one(self, client: TestClient, auth: dict[str, str]) -> None:
        for raw in (b"[[[[1]]]]", b'{"a": 1}', b"[1, 2, 3]", b"null"):
            cursor = base64.urlsafe_b64encode(raw).decode()
            r = client.get("/v1/runs", params={"cursor": cursor}, headers=auth)
            assert refused_fields(r) == ["cursor"]

    def test_an_issued_runs_cursor_still_pages(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        for name in ("a", "b", "c"):
            (tmp_path / name).mkdir()
            start_run(client, auth, tmp_path / name, settings, session_factory)
        first = client.get("/v1/runs", params={"limit": 2}, headers=auth).json()
        assert first["next_cursor"]
        rest = client.get(
            "/v1/runs", params={"limit": 2, "cursor": first["next_cursor"]}, headers=auth
        ).json()
        assert len(first["data"]) + len(rest["data"]) == 3

    def test_an_oversized_metrics_cursor(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, _ = started
        cursor = "1:1:" + "x" * 20_000
        r = client.get(f"/v1/runs/{run_id}/metrics", params={"cursor": cursor}, headers=auth)
        assert refused_fields(r) == ["cursor"]


class TestNulInStrings:
    """PostgreSQL text cannot hold NUL; SQLite can, and answers the same for consistency."""

    def test_metric_name_filter(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, _ = started
        r = client.get(f"/v1/runs/{run_id}/metrics", params={"name": "lo\x00ss"}, headers=auth)
        assert refused_fields(r) == ["name"]

    def test_metrics_cursor(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, _ = started
        r = client.get(
            f"/v1/runs/{run_id}/metrics", params={"cursor": "1:1:lo\x00ss"}, headers=auth
        )
        assert refused_fields(r) == ["cursor"]

    @pytest.mark.parametrize("suffix", ["", "/metrics", "/checkpoints", "/events"])
    def test_run_id(self, client: TestClient, auth: dict[str, str], suffix: str) -> None:
        # No run has such an id: not found, as any unknown id (test_api8_nul_ids.py).
        r = client.get(f"/v1/runs/run_%00x{suffix}", headers=auth)
        assert r.status_code == 404, r.text

    def test_a_worker_post_to_a_run_id_with_nul_is_401(self, client: TestClient) -> None:
        r = client.post(
            "/v1/internal/runs/run_%00x/status",
            json={"attempt": 1, "status": "running"},
            headers={"Authorization": "Bearer rt_x"},
        )
        assert r.status_code == 401

    @pytest.mark.parametrize(
        ("route", "body"),
        [
            ("metrics", {"points": [_point(name="lo\x00ss")]}),
            ("checkpoints", {"step": 1, "path": "/c\x00", "kind": "hf"}),
        ],
        ids=["metric-name", "checkpoint-path"],
    )
    def test_callback_names(
        self,
        client: TestClient,
        started: tuple[str, dict[str, str]],
        route: str,
        body: dict[str, Any],
    ) -> None:
        run_id, worker = started
        r = client.post(
            f"/v1/internal/runs/{run_id}/{route}",
            content=json.dumps({"attempt": 1, **body}),
            headers={**worker, "Content-Type": "application/json"},
        )
        assert r.status_code == 422, r.text
        # (A body field called `path` is named "body" today: app/errors.py drops every
        # "path" from the location, taking it for the path parameters' marker.)
        assert [p["message"] for p in r.json()["detail"]] == ["must not contain NUL characters"]

    def test_a_failure_message_with_nul_is_kept(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        """Refusing it would lose why the run failed: the NUL is replaced instead."""
        run_id, worker = started
        error = {"code": "training_error", "message": "bad byte \x00 in data.bin"}
        r = client.post(
            f"/v1/internal/runs/{run_id}/status",
            json={"attempt": 1, "status": "failed", "error": error},
            headers=worker,
        )
        assert r.status_code == 200, r.text
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["status"] == "failed"
        assert run["error"]["message"] == "bad byte \ufffd in data.bin"
