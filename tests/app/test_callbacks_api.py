"""What workers post back (/v1/internal/runs/…), on a real database, without Ray."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from tests.app.conftest import start_run
from tests.app.worker_calls import post_status, run_location


def _points(steps: range, name: str = "loss", base: float = 5.0) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat()
    return [{"step": s, "name": name, "value": base - s * 0.1, "time": now} for s in steps]


class TestStatusCallback:
    def test_running_then_succeeded(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["status"] == "starting"

        r = post_status(client, run_id, worker, "running")
        assert r.status_code == 200, r.text
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["status"] == "running"
        assert run["started_at"] is not None

        post_status(client, run_id, worker, "succeeded")
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["status"] == "succeeded"
        assert run["finished_at"] is not None

    def test_failed_carries_the_error(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        error = {"code": "training_error", "message": "dataset has no field 'text'"}
        post_status(client, run_id, worker, "failed", error=error)
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["status"] == "failed"
        assert run["error"] == error

    def test_a_finished_run_no_longer_accepts_its_token(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        post_status(client, run_id, worker, "succeeded")
        late = post_status(client, run_id, worker, "running")
        assert late.status_code == 401

    def test_wrong_token_is_401(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, _ = started
        for headers in ({}, {"Authorization": "Bearer rt_wrong"}):
            r = post_status(client, run_id, headers, "running")
            assert r.status_code == 401

    def test_a_token_is_good_for_its_own_run_only(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        started: tuple[str, dict[str, str]],
    ) -> None:
        _, first_worker = started
        (tmp_path / "other").mkdir()
        second_id, _ = start_run(client, auth, tmp_path / "other", settings, session_factory)
        r = post_status(client, second_id, first_worker, "running")
        assert r.status_code == 401
        assert client.get(f"/v1/runs/{second_id}", headers=auth).json()["status"] == "starting"

    def test_an_old_attempt_is_409(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        r = post_status(client, run_id, worker, "running", attempt=0)
        assert r.status_code == 409


class TestMetricsCallback:
    def test_stored_once_per_step_and_name(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        body = {
            "attempt": 1,
            "points": _points(range(1, 6)),
            "progress": {"step": 5, "total_steps": 10, "epoch": 0.5},
        }
        for _ in range(2):  # a retried post must not duplicate anything
            r = client.post(f"/v1/internal/runs/{run_id}/metrics", json=body, headers=worker)
            assert r.status_code == 200, r.text

        data = client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        assert [(m["step"], m["name"]) for m in data] == [(s, "loss") for s in range(1, 6)]
        assert data[-1]["value"] == pytest.approx(4.5)

        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["progress"]["step"] == 5
        assert run["progress"]["total_steps"] == 10
        assert run["progress"]["fraction"] == pytest.approx(0.5)
        assert run["latest_metrics"]["loss"] == pytest.approx(4.5)

    def test_trained_tokens_are_null_until_the_job_ends(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        # OpenAI documents `trained_tokens` as null while the job runs, not a running count.
        run_id, worker = started
        post_status(client, run_id, worker, "running", check=True)
        body = {"attempt": 1, "points": _points(range(1, 4), name="tokens", base=100.0)}
        r = client.post(f"/v1/internal/runs/{run_id}/metrics", json=body, headers=worker)
        assert r.status_code == 200, r.text
        jobs = f"/v1/fine_tuning/jobs/{run_id}"
        assert client.get(jobs, headers=auth).json()["trained_tokens"] is None
        listed = client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"]
        assert [job["trained_tokens"] for job in listed] == [None]
        post_status(client, run_id, worker, "succeeded", check=True)
        # 99.9 + 99.8 + 99.7, each step's value truncated to whole tokens once summed.
        assert client.get(jobs, headers=auth).json()["trained_tokens"] == 299
        listed = client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"]
        assert [job["trained_tokens"] for job in listed] == [299]

    def test_out_of_order_posts_keep_the_latest_step(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        late = {"attempt": 1, "points": _points(range(6, 8)), "progress": {"step": 7}}
        early = {"attempt": 1, "points": _points(range(1, 3)), "progress": {"step": 2}}
        client.post(f"/v1/internal/runs/{run_id}/metrics", json=late, headers=worker)
        client.post(f"/v1/internal/runs/{run_id}/metrics", json=early, headers=worker)

        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["progress"]["step"] == 7
        assert run["latest_metrics"]["loss"] == pytest.approx(5.0 - 0.7)
        steps = [
            m["step"] for m in client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        ]
        assert steps == [1, 2, 6, 7]

    def test_filter_and_paginate(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        points = _points(range(1, 11)) + _points(range(1, 11), name="learning_rate", base=1.0)
        client.post(
            f"/v1/internal/runs/{run_id}/metrics",
            json={"attempt": 1, "points": points},
            headers=worker,
        )

        url = f"/v1/runs/{run_id}/metrics"
        only_loss = client.get(url, params={"name": "loss", "after_step": 7}, headers=auth).json()
        assert [(m["name"], m["step"]) for m in only_loss["data"]] == [
            ("loss", 8),
            ("loss", 9),
            ("loss", 10),
        ]

        collected, cursor = [], None
        while True:
            params: dict[str, Any] = {"limit": 3}
            if cursor:
                params["cursor"] = cursor
            page = client.get(url, params=params, headers=auth).json()
            collected += [(m["step"], m["name"]) for m in page["data"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert len(collected) == 20
        assert len(set(collected)) == 20
        assert collected == sorted(collected)


class TestCheckpointCallback:
    def test_recorded_and_shown_on_the_run(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        checkpoint = run_location(settings, run_id, "checkpoint_5")
        export = run_location(settings, run_id, "export")
        ds = {
            "attempt": 1,
            "step": 5,
            "epoch": 0.5,
            "path": checkpoint,
            "kind": "deepspeed",
            "metrics": {"loss": 4.0},
        }
        hf = {**ds, "path": export, "kind": "hf"}
        for body in (ds, ds, hf):  # the repeat is a retry: stored once
            r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
            assert r.status_code == 200, r.text

        listed = client.get(f"/v1/runs/{run_id}/checkpoints", headers=auth).json()["data"]
        assert [(c["kind"], c["path"], c["step"]) for c in listed] == [
            ("deepspeed", checkpoint, 5),
            ("hf", export, 5),
        ]
        assert listed[0]["metrics"] == {"loss": 4.0}
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["output"] == {"model_path": export, "latest_checkpoint": checkpoint}

    def test_checkpoints_beyond_keep_last_are_marked_pruned(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        keep_last = run["spec"]["checkpointing"]["keep_last"]
        steps = list(range(1, keep_last + 3))
        for step in steps:
            path = run_location(settings, run_id, f"ckpt_{step}")
            body = {"attempt": 1, "step": step, "path": path, "kind": "deepspeed"}
            r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
            assert r.status_code == 200, r.text
        path = run_location(settings, run_id, "export")
        export = {"attempt": 1, "step": steps[-1], "path": path, "kind": "hf"}
        client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=export, headers=worker)
        listed = client.get(f"/v1/runs/{run_id}/checkpoints", headers=auth).json()["data"]
        pruned = {Path(c["path"]).name: c["pruned"] for c in listed}
        # Ray Train deleted all but the newest keep_last; an export is never pruned.
        assert pruned == {
            **{f"ckpt_{s}": s <= steps[-1] - keep_last for s in steps},
            "export": False,
        }

    def test_unknown_kind_is_422(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        body = {"attempt": 1, "step": 5, "path": "/x", "kind": "pickle"}
        r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
        assert r.status_code == 422


class TestStartupPhaseEvents:
    def test_stored_and_served_with_their_phase_and_duration(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        url = f"/v1/internal/runs/{run_id}/events"
        for phase, seconds in (("job", 1.25), ("data", 0.5)):
            r = client.post(
                url,
                headers=worker,
                json={
                    "attempt": 1,
                    "type": "startup_phase",
                    "message": f"{phase}: {seconds}s",
                    "phase": phase,
                    "duration_seconds": seconds,
                },
            )
            assert r.status_code == 200, r.text
        client.post(url, headers=worker, json={"attempt": 1, "type": "message", "message": "hi"})
        # A worker group Ray Train restarted within the attempt: its start is not the
        # attempt's, and the first of each phase stays.
        again = {"type": "startup_phase", "message": "job: 9s", "phase": "job"}
        r = client.post(url, headers=worker, json={"attempt": 1, **again, "duration_seconds": 9})
        assert r.status_code == 200, r.text
        events = client.get(f"/v1/runs/{run_id}/events", headers=auth).json()["data"]
        phases = [
            (e["type"], e["phase"], e["duration_seconds"])
            for e in events
            if e["type"] in ("startup_phase", "message")
        ]
        assert phases == [
            ("startup_phase", "job", 1.25),
            ("startup_phase", "data", 0.5),
            ("message", None, None),
        ]
        # OpenAI's event list (a run is a job) carries them in each event's data.
        listed = client.get(f"/v1/fine_tuning/jobs/{run_id}/events", headers=auth).json()["data"]
        data = [e["data"] for e in listed if e["data"]["type"] in ("startup_phase", "message")]
        assert [(d.get("phase"), d.get("duration_seconds")) for d in data] == [
            (None, None),
            ("data", 0.5),
            ("job", 1.25),
        ]

    @pytest.mark.parametrize(
        ("body", "named"),
        [
            ({"type": "startup_phase"}, "names its phase and its duration_seconds"),
            ({"type": "startup_phase", "phase": "data"}, "names its phase"),
            (
                {"type": "message", "phase": "data", "duration_seconds": 1.0},
                "only a startup_phase event",
            ),
            ({"type": "startup_phase", "phase": "dinner", "duration_seconds": 1.0}, "phase"),
            ({"type": "startup_phase", "phase": "data", "duration_seconds": -1}, "duration"),
            ({"type": "startup_phase", "phase": "data", "duration_seconds": "NaN"}, "duration"),
        ],
    )
    def test_a_phase_without_its_type_or_a_bad_duration_is_422(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        body: dict[str, Any],
        named: str,
    ) -> None:
        run_id, worker = started
        r = client.post(
            f"/v1/internal/runs/{run_id}/events",
            headers=worker,
            json={"attempt": 1, "message": "m", **body},
        )
        assert r.status_code == 422, r.text
        assert named in r.text
        events = client.get(f"/v1/runs/{run_id}/events", headers=auth).json()["data"]
        assert not [e for e in events if e["message"] == "m"]


class TestContradictoryCallbacks:
    """Bodies a worker never sends, which would leave a run that contradicts itself."""

    @pytest.mark.parametrize(
        ("body", "named"),
        [
            (
                {
                    "status": "succeeded",
                    "error": {"code": "training_error", "message": "boom"},
                },
                "only a failed status carries an error",
            ),
            ({"status": "failed", "error": None}, "a failed status carries its error"),
            ({"status": "running", "attempt": True}, "attempt"),
        ],
    )
    def test_a_status_at_odds_with_itself_is_422_and_changes_nothing(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        body: dict[str, Any],
        named: str,
    ) -> None:
        run_id, worker = started
        r = client.post(
            f"/v1/internal/runs/{run_id}/status", headers=worker, json={"attempt": 1, **body}
        )
        assert r.status_code == 422, r.text
        assert named in r.text
        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert (run["status"], run["error"]) == ("starting", None)

    @pytest.mark.parametrize(
        ("point", "progress", "named"),
        [
            # Past year 9999 once in UTC: PostgreSQL stored it, and every read of the run's
            # metrics failed after.
            ({"time": "9999-12-31T23:59:59-14:00"}, None, "out of range"),
            ({"time": "0001-01-01T00:00:00+14:00"}, None, "out of range"),
            # Read back in a session east of UTC, the last day of 9999 is in year 10000.
            ({"time": "9999-06-01T00:00:00Z"}, None, "between the years 1970 and 9998"),
            ({}, {"step": 10, "total_steps": 3}, "past progress.total_steps"),
        ],
    )
    def test_times_and_progress_out_of_range_are_422(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        point: dict[str, Any],
        progress: dict[str, Any] | None,
        named: str,
    ) -> None:
        run_id, worker = started
        body: dict[str, Any] = {
            "attempt": 1,
            "points": [{**_points(range(1, 2))[0], **point}],
        }
        if progress is not None:
            body["progress"] = progress
        r = client.post(f"/v1/internal/runs/{run_id}/metrics", headers=worker, json=body)
        assert r.status_code == 422, r.text
        assert named in r.text
        assert client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"] == []

    def test_a_time_with_an_offset_is_stored_as_the_same_instant(
        self, client: TestClient, auth: dict[str, str], started: tuple[str, dict[str, str]]
    ) -> None:
        run_id, worker = started
        point = {"step": 1, "name": "loss", "value": 1.0, "time": "2026-11-29T12:00:00+02:00"}
        r = client.post(
            f"/v1/internal/runs/{run_id}/metrics",
            headers=worker,
            json={"attempt": 1, "points": [point]},
        )
        assert r.status_code == 200, r.text
        (stored,) = client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        assert datetime.fromisoformat(stored["time"]) == datetime(2026, 11, 29, 10, tzinfo=UTC)
