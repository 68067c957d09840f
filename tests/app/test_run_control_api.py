"""Cancel, resume, events, the SSE stream, logs and queue positions, on a real database.

The app under test has no Ray; where a route needs one, the test attaches the scripted
stand-in from test_dispatch (a real cluster cannot be made to answer on cue).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import JobState, RayUnavailable
from app.services.dispatch import Dispatcher
from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import post_status, run_location, worker_headers
from tests.conftest import make_api_key
from tests.factories import run_request


@dataclass
class Live:
    """A run the scripted Ray received: its id, that Ray, and the worker's headers."""

    run_id: str
    ray: ScriptedRay
    worker: dict[str, str]


def _create(client: TestClient, auth: dict[str, str], root: Path) -> str:
    r = client.post("/v1/runs", json=run_request(root), headers=auth)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _start(
    client: TestClient,
    auth: dict[str, str],
    root: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> Live:
    """Create a run and dispatch it to a scripted Ray that the app also uses."""
    run_id = _create(client, auth, root)
    ray = dispatch_to(ScriptedRay(), settings, session_factory)
    client.app.state.tuneyard.jobs = ray
    return Live(run_id=run_id, ray=ray, worker=worker_headers(ray))


def _confirm_stopped(
    live: Live, settings: Settings, session_factory: sessionmaker[Session]
) -> None:
    """Ray reports the job STOPPED and the reconciler makes one pass."""
    live.ray.states[f"{live.run_id}-1"] = JobState(status="STOPPED", message="")
    jobs: Any = live.ray
    Dispatcher(settings=settings, session_factory=session_factory, jobs=jobs).reconcile_live_runs()


def _get(client: TestClient, auth: dict[str, str], run_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/runs/{run_id}", headers=auth)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _events(client: TestClient, auth: dict[str, str], run_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/runs/{run_id}/events", headers=auth)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def _statuses(events: list[dict[str, Any]]) -> list[str]:
    return [e["status"] for e in events if e["type"] == "status"]


def _points(steps: range, name: str = "loss") -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat()
    return [{"step": s, "name": name, "value": 5.0 - s * 0.1, "time": now} for s in steps]


def _run_in(
    status: str,
    client: TestClient,
    auth: dict[str, str],
    root: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> str:
    """A run of the caller's, brought to `status` the way it gets there in service."""
    if status in ("queued", "cancelled"):
        run_id = _create(client, auth, root)
        if status == "cancelled":
            assert client.post(f"/v1/runs/{run_id}/cancel", headers=auth).status_code == 200
        return run_id
    live = _start(client, auth, root, settings, session_factory)
    if status == "cancelling":
        assert client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth).status_code == 200
    elif status != "starting":
        post_status(client, live.run_id, live.worker, "running", check=True)
        if status != "running":
            post_status(client, live.run_id, live.worker, status, check=True)
    assert _get(client, auth, live.run_id)["status"] == status
    return live.run_id


class TestCancel:
    def test_a_queued_run_is_cancelled_at_once(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        run_id = _create(client, auth, tmp_path)
        r = client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled"
        assert r.json()["finished_at"] is not None

        run = _get(client, auth, run_id)
        assert run["status"] == "cancelled"
        assert run["finished_at"] is not None
        assert run["error"] is None
        last = _events(client, auth, run_id)[-1]
        assert (last["type"], last["status"]) == ("status", "cancelled")

    @pytest.mark.parametrize("status", ["starting", "running"])
    def test_a_live_run_becomes_cancelling_and_ray_is_asked_to_stop_it(
        self,
        status: str,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        if status == "running":
            post_status(client, live.run_id, live.worker, "running", check=True)

        r = client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelling"
        assert r.json()["finished_at"] is None
        assert live.ray.stopped == [f"{live.run_id}-1"]
        assert _get(client, auth, live.run_id)["status"] == "cancelling"
        assert _statuses(_events(client, auth, live.run_id))[-1] == "cancelling"

    def test_repeating_a_cancel_is_harmless_and_does_not_ask_ray_again(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        first = client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)
        again = client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)
        assert (first.status_code, again.status_code) == (200, 200)
        assert again.json()["status"] == "cancelling"
        assert live.ray.stopped == [f"{live.run_id}-1"]
        assert _statuses(_events(client, auth, live.run_id)).count("cancelling") == 1

    def test_repeating_a_cancel_of_a_cancelled_run_changes_nothing(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        run_id = _create(client, auth, tmp_path)
        first = client.post(f"/v1/runs/{run_id}/cancel", headers=auth).json()
        again = client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
        assert again.status_code == 200
        assert again.json()["status"] == "cancelled"
        assert again.json()["finished_at"] == first["finished_at"]
        assert _statuses(_events(client, auth, run_id)) == ["queued", "cancelled"]

    def test_ray_unreachable_still_records_the_cancel(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)

        def down(_: str) -> None:
            raise RayUnavailable("cannot reach Ray at http://ray.invalid")

        monkeypatch.setattr(live.ray, "stop", down)
        r = client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)
        assert r.status_code == 200, r.text
        # The reconciler asks Ray again on its next pass.
        assert _get(client, auth, live.run_id)["status"] == "cancelling"

    @pytest.mark.parametrize("status", ["succeeded", "failed"])
    def test_a_finished_run_is_409_naming_its_status(
        self,
        status: str,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = _run_in(status, client, auth, tmp_path, settings, session_factory)
        before = _get(client, auth, run_id)
        r = client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
        assert r.status_code == 409
        assert r.json()["error"] == "conflict"
        assert f"is {status}" in r.json()["detail"]
        assert _get(client, auth, run_id) == before

    def test_another_principals_run_is_404(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = _create(client, auth, tmp_path)
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        assert client.post(f"/v1/runs/{run_id}/cancel", headers=other).status_code == 404
        assert client.post("/v1/runs/run_missing/cancel", headers=auth).status_code == 404
        assert _get(client, auth, run_id)["status"] == "queued"

    def test_a_worker_failing_while_cancelling_ends_the_run_cancelled_once_ray_confirms(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        post_status(client, live.run_id, live.worker, "running", check=True)
        client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)

        # Stopping the job makes its workers fail; the user asked for a cancel, not a failure.
        error = {"code": "training_error", "message": "worker got SIGTERM"}
        reply = post_status(client, live.run_id, live.worker, "failed", error=error, check=True)
        assert reply.json() == {"status": "cancelling"}
        run = _get(client, auth, live.run_id)
        assert (run["status"], run["error"], run["finished_at"]) == ("cancelling", None, None)
        assert "worker got SIGTERM" in _events(client, auth, live.run_id)[-1]["message"]

        _confirm_stopped(live, settings, session_factory)
        run = _get(client, auth, live.run_id)
        assert (run["status"], run["error"]) == ("cancelled", None)
        assert run["finished_at"] is not None
        assert _statuses(_events(client, auth, live.run_id))[-2:] == ["cancelling", "cancelled"]

    def test_a_late_running_report_does_not_undo_cancelling(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)

        reply = post_status(client, live.run_id, live.worker, "running", check=True)
        assert reply.json() == {"status": "cancelling"}
        run = _get(client, auth, live.run_id)
        assert run["status"] == "cancelling"
        assert _statuses(_events(client, auth, live.run_id))[-1] == "cancelling"


class TestResume:
    def test_a_failed_run_is_queued_again_as_a_new_attempt(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        post_status(client, live.run_id, live.worker, "running", check=True)
        path = run_location(settings, live.run_id, "checkpoint_3")
        checkpoint = {"attempt": 1, "step": 3, "path": path}
        r = client.post(
            f"/v1/internal/runs/{live.run_id}/checkpoints",
            json={**checkpoint, "kind": "deepspeed"},
            headers=live.worker,
        )
        assert r.status_code == 200, r.text
        error = {"code": "training_error", "message": "CUDA out of memory"}
        post_status(client, live.run_id, live.worker, "failed", error=error, check=True)
        assert _get(client, auth, live.run_id)["error"] == error

        r = client.post(f"/v1/runs/{live.run_id}/resume", headers=auth)
        assert r.status_code == 200, r.text
        run = _get(client, auth, live.run_id)
        assert r.json()["status"] == run["status"] == "queued"
        assert run["attempt"] == 2
        assert run["error"] is None
        assert run["finished_at"] is None
        assert run["ray_submission_id"] is None
        assert run["output"]["latest_checkpoint"] == path
        last = _events(client, auth, live.run_id)[-1]
        assert (last["type"], last["status"], last["attempt"]) == ("status", "queued", 2)

    def test_the_new_attempt_runs_under_a_new_id_and_token(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        post_status(client, live.run_id, live.worker, "failed", check=True)
        client.post(f"/v1/runs/{live.run_id}/resume", headers=auth)

        dispatch_to(live.ray, settings, session_factory)
        assert [j["submission_id"] for j in live.ray.submitted] == [
            f"{live.run_id}-1",
            f"{live.run_id}-2",
        ]
        second = worker_headers(live.ray)
        assert second != live.worker
        run = _get(client, auth, live.run_id)
        assert (run["status"], run["attempt"], run["ray_submission_id"]) == (
            "starting",
            2,
            f"{live.run_id}-2",
        )

        # The first attempt's worker may still be alive somewhere: it is refused everywhere.
        now = datetime.now(UTC).isoformat()
        for attempt in (1, 2):
            bodies = {
                "status": {"attempt": attempt, "status": "running"},
                "metrics": {"attempt": attempt, "points": _points(range(1, 2))},
                "checkpoints": {"attempt": attempt, "step": 1, "path": "/x", "kind": "hf"},
                "events": {"attempt": attempt, "type": "message", "message": now},
            }
            for route, body in bodies.items():
                r = client.post(
                    f"/v1/internal/runs/{live.run_id}/{route}", json=body, headers=live.worker
                )
                assert r.status_code == 401, (route, attempt, r.text)
        assert _get(client, auth, live.run_id)["status"] == "starting"
        assert _get(client, auth, live.run_id)["output"]["model_path"] is None

        reply = post_status(client, live.run_id, second, "running", attempt=2, check=True)
        assert reply.json() == {"status": "running"}

    @pytest.mark.parametrize("status", ["queued", "starting", "running", "cancelling", "succeeded"])
    def test_a_run_that_is_not_failed_or_cancelled_is_409_naming_its_status(
        self,
        status: str,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = _run_in(status, client, auth, tmp_path, settings, session_factory)
        before = _get(client, auth, run_id)
        r = client.post(f"/v1/runs/{run_id}/resume", headers=auth)
        assert r.status_code == 409
        assert r.json()["error"] == "conflict"
        assert f"is {status}" in r.json()["detail"]
        assert _get(client, auth, run_id) == before

    def test_a_cancelled_run_can_be_resumed(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        live = _start(client, auth, tmp_path, settings, session_factory)
        client.post(f"/v1/runs/{live.run_id}/cancel", headers=auth)
        post_status(client, live.run_id, live.worker, "failed", check=True)
        _confirm_stopped(live, settings, session_factory)
        assert _get(client, auth, live.run_id)["status"] == "cancelled"

        r = client.post(f"/v1/runs/{live.run_id}/resume", headers=auth)
        assert r.status_code == 200, r.text
        run = _get(client, auth, live.run_id)
        assert (run["status"], run["attempt"], run["finished_at"]) == ("queued", 2, None)
        dispatch_to(live.ray, settings, session_factory)
        assert live.ray.submitted[-1]["submission_id"] == f"{live.run_id}-2"

    def test_another_principals_run_is_404(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id = _create(client, auth, tmp_path)
        client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        assert client.post(f"/v1/runs/{run_id}/resume", headers=other).status_code == 404
        assert _get(client, auth, run_id)["status"] == "cancelled"


class TestEvents:
    @pytest.fixture
    def finished(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> str:
        """A run that went queued → starting → running (with a worker message) → succeeded."""
        live = _start(client, auth, tmp_path, settings, session_factory)
        post_status(client, live.run_id, live.worker, "running", check=True)
        r = client.post(
            f"/v1/internal/runs/{live.run_id}/events",
            json={"attempt": 1, "type": "message", "message": "model loaded"},
            headers=live.worker,
        )
        assert r.status_code == 200, r.text
        post_status(client, live.run_id, live.worker, "succeeded", check=True)
        return live.run_id

    def test_status_changes_and_messages_oldest_first(
        self, client: TestClient, auth: dict[str, str], finished: str
    ) -> None:
        events = _events(client, auth, finished)
        assert [(e["type"], e["status"]) for e in events] == [
            ("status", "queued"),
            ("status", "starting"),
            ("status", "running"),
            ("message", None),
            ("status", "succeeded"),
        ]
        assert events[3]["message"] == "model loaded"
        ids = [e["id"] for e in events]
        assert ids == sorted(ids)
        assert len(set(ids)) == len(ids)
        assert {e["attempt"] for e in events} == {1}

    def test_after_returns_only_later_events(
        self, client: TestClient, auth: dict[str, str], finished: str
    ) -> None:
        ids = [e["id"] for e in _events(client, auth, finished)]
        url = f"/v1/runs/{finished}/events"
        later = client.get(url, params={"after": ids[1]}, headers=auth).json()["data"]
        assert [e["id"] for e in later] == ids[2:]
        assert client.get(url, params={"after": ids[-1]}, headers=auth).json()["data"] == []

    def test_limit_pages_with_after(
        self, client: TestClient, auth: dict[str, str], finished: str
    ) -> None:
        ids = [e["id"] for e in _events(client, auth, finished)]
        url = f"/v1/runs/{finished}/events"
        pages: list[list[int]] = []
        after: int | None = None
        for _ in range(len(ids) + 1):  # more pages than events: paging is stuck
            params = {"limit": 2} if after is None else {"limit": 2, "after": after}
            page = client.get(url, params=params, headers=auth).json()["data"]
            if not page:
                break
            pages.append([e["id"] for e in page])
            after = page[-1]["id"]
        assert pages == [ids[0:2], ids[2:4], ids[4:]]
        for bad in (0, 1001):
            assert client.get(url, params={"limit": bad}, headers=auth).status_code == 422

    def test_events_of_other_runs_are_not_mixed_in(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        finished: str,
        session_factory: sessionmaker[Session],
    ) -> None:
        (tmp_path / "other").mkdir()
        other_run = _create(client, auth, tmp_path / "other")
        assert _statuses(_events(client, auth, other_run)) == ["queued"]
        assert len(_events(client, auth, finished)) == 5

        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        assert client.get(f"/v1/runs/{finished}/events", headers=other).status_code == 404


@dataclass(frozen=True)
class Frame:
    event: str
    id: str
    data: str


# A finished run's stream ends after one poll; one that never ends is a failure, not a hang.
STREAM_DEADLINE_S = 20


def _read_stream(
    client: TestClient, auth: dict[str, str], run_id: str, last_event_id: str | None = None
) -> list[Frame]:
    headers = dict(auth)
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    with client.stream("GET", f"/v1/runs/{run_id}/events/stream", headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        deadline = time.monotonic() + STREAM_DEADLINE_S
        chunks = []
        for chunk in r.iter_text():
            chunks.append(chunk)
            if time.monotonic() > deadline:
                pytest.fail(f"the stream of a finished run did not end: {''.join(chunks)[-500:]}")
    return _parse_sse("".join(chunks))


def _parse_sse(text: str) -> list[Frame]:
    """Frames are blank-line separated; lines are `field: value`; `:` lines are comments."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    frames = []
    for block in text.split("\n\n"):
        fields: dict[str, list[str]] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))
        if "data" in fields or "event" in fields:
            frames.append(
                Frame(
                    event=fields.get("event", ["message"])[-1],
                    id=fields["id"][-1],
                    data="\n".join(fields.get("data", [])),
                )
            )
    return frames


def _cursor(frame_id: str) -> tuple[int, int]:
    event_id, metric_id = frame_id.split(":")
    return int(event_id), int(metric_id)


@pytest.mark.timeout(120)
class TestEventStream:
    @pytest.fixture
    def finished(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> str:
        """A succeeded run with four status events and five metric points."""
        live = _start(client, auth, tmp_path, settings, session_factory)
        post_status(client, live.run_id, live.worker, "running", check=True)
        for steps in (range(1, 4), range(4, 6)):
            r = client.post(
                f"/v1/internal/runs/{live.run_id}/metrics",
                json={"attempt": 1, "points": _points(steps)},
                headers=live.worker,
            )
            assert r.status_code == 200, r.text
        post_status(client, live.run_id, live.worker, "succeeded", check=True)
        return live.run_id

    def test_a_finished_run_streams_everything_then_ends(
        self, client: TestClient, auth: dict[str, str], finished: str
    ) -> None:
        frames = _read_stream(client, auth, finished)
        kinds = [f.event for f in frames]
        assert kinds.count("event") == 4
        assert kinds.count("metric") == 5
        assert kinds[-1] == "end"
        assert kinds.count("end") == 1

        stored = client.get(f"/v1/runs/{finished}/events", headers=auth).json()["data"]
        assert [json.loads(f.data) for f in frames if f.event == "event"] == stored
        metrics = [json.loads(f.data) for f in frames if f.event == "metric"]
        assert metrics == client.get(f"/v1/runs/{finished}/metrics", headers=auth).json()["data"]
        assert [(m["step"], m["name"]) for m in metrics] == [(s, "loss") for s in range(1, 6)]
        assert json.loads(frames[-1].data) == {"run_id": finished}

        cursors = [_cursor(f.id) for f in frames]
        for before, after in itertools.pairwise(cursors):
            assert after[0] >= before[0] and after[1] >= before[1], (before, after)
        # Each event frame's id carries that event's id.
        event_frames = [f for f in frames if f.event == "event"]
        assert [_cursor(f.id)[0] for f in event_frames] == [e["id"] for e in stored]
        metric_ids = [_cursor(f.id)[1] for f in frames if f.event == "metric"]
        assert metric_ids == sorted(set(metric_ids))
        assert len(metric_ids) == 5
        assert frames[-1].id == frames[-2].id

    @pytest.mark.parametrize("where", ["among events", "among metrics", "last before end"])
    def test_reconnecting_with_last_event_id_continues_without_loss_or_repeats(
        self, where: str, client: TestClient, auth: dict[str, str], finished: str
    ) -> None:
        frames = _read_stream(client, auth, finished)
        kinds = [f.event for f in frames]
        index = {
            "among events": 1,
            "among metrics": kinds.index("metric") + 1,
            "last before end": len(frames) - 2,
        }[where]
        rest = _read_stream(client, auth, finished, last_event_id=frames[index].id)
        assert rest == frames[index + 1 :]

    @pytest.mark.parametrize("bad", ["abc", "7", "1:x", "1:2:3", ":"])
    def test_a_malformed_last_event_id_is_422(
        self, bad: str, client: TestClient, auth: dict[str, str], finished: str
    ) -> None:
        r = client.get(f"/v1/runs/{finished}/events/stream", headers={**auth, "Last-Event-ID": bad})
        assert r.status_code == 422
        assert r.json()["detail"][0]["field"] == "Last-Event-ID"

    def test_another_principals_run_is_404(
        self,
        client: TestClient,
        finished: str,
        session_factory: sessionmaker[Session],
    ) -> None:
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        r = client.get(f"/v1/runs/{finished}/events/stream", headers=other)
        assert r.status_code == 404


class TestLogs:
    RAY_TOKEN = "ray-auth-" + "k9" * 24

    @pytest.fixture
    def live(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        monkeypatch: pytest.MonkeyPatch,
    ) -> Live:
        monkeypatch.setenv("RAY_AUTH_TOKEN", self.RAY_TOKEN)
        live = _start(client, auth, tmp_path, settings, session_factory)
        live.ray.logs_text = "\n".join(
            [
                "step 1 loss 4.9",
                "step 2 loss 4.8",
                "GET /healthz Authorization: Bearer abc.def",
                f"ray client: token={self.RAY_TOKEN}",
            ]
        )
        return live

    def test_the_job_log_as_plain_text_with_secrets_taken_out(
        self, client: TestClient, auth: dict[str, str], live: Live
    ) -> None:
        r = client.get(f"/v1/runs/{live.run_id}/logs", headers=auth)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert r.text.splitlines() == [
            "step 1 loss 4.9",
            "step 2 loss 4.8",
            "GET /healthz Authorization: Bearer [redacted]",
            "ray client: token=[redacted]",
        ]
        assert "abc.def" not in r.text
        assert self.RAY_TOKEN not in r.text

    def test_tail_gives_the_last_lines_still_redacted(
        self, client: TestClient, auth: dict[str, str], live: Live
    ) -> None:
        r = client.get(f"/v1/runs/{live.run_id}/logs", params={"tail": 2}, headers=auth)
        assert r.status_code == 200, r.text
        assert r.text.splitlines() == [
            "GET /healthz Authorization: Bearer [redacted]",
            "ray client: token=[redacted]",
        ]
        assert "abc.def" not in r.text
        assert self.RAY_TOKEN not in r.text
        many = client.get(f"/v1/runs/{live.run_id}/logs", params={"tail": 100}, headers=auth)
        assert len(many.text.splitlines()) == 4
        for bad in (0, -1):
            r = client.get(f"/v1/runs/{live.run_id}/logs", params={"tail": bad}, headers=auth)
            assert r.status_code == 422

    def test_a_run_never_submitted_has_no_log(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        ray = ScriptedRay()
        ray.logs_text = "a log of some other job"
        client.app.state.tuneyard.jobs = ray
        run_id = _create(client, auth, tmp_path)
        r = client.get(f"/v1/runs/{run_id}/logs", headers=auth)
        assert r.status_code == 200
        assert r.text == ""

    def test_no_ray_attached_is_503(
        self, client: TestClient, auth: dict[str, str], live: Live
    ) -> None:
        client.app.state.tuneyard.jobs = None
        r = client.get(f"/v1/runs/{live.run_id}/logs", headers=auth)
        assert r.status_code == 503
        assert r.json()["error"] == "ray_unavailable"

    def test_ray_unreachable_is_503(
        self,
        client: TestClient,
        auth: dict[str, str],
        live: Live,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        def down(_: str) -> str:
            raise RayUnavailable(f"cannot read logs of {live.run_id}-1: connection refused")

        monkeypatch.setattr(live.ray, "logs", down)
        r = client.get(f"/v1/runs/{live.run_id}/logs", headers=auth)
        assert r.status_code == 503
        assert r.json()["error"] == "ray_unavailable"

    def test_another_principals_run_is_404(
        self, client: TestClient, live: Live, session_factory: sessionmaker[Session]
    ) -> None:
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        assert client.get(f"/v1/runs/{live.run_id}/logs", headers=other).status_code == 404


class TestQueuePosition:
    def test_oldest_queued_is_first_and_a_dispatched_run_has_none(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        ids = []
        for i in range(3):
            (tmp_path / str(i)).mkdir()
            ids.append(_create(client, auth, tmp_path / str(i)))
        assert [_get(client, auth, i)["queue_position"] for i in ids] == [1, 2, 3]

        one = settings.model_copy(update={"max_concurrent_runs": 1})
        dispatch_to(ScriptedRay(), one, session_factory)
        assert [_get(client, auth, i)["queue_position"] for i in ids] == [None, 1, 2]

    def test_a_cancelled_run_leaves_the_queue_and_a_resumed_one_joins_at_the_back(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
    ) -> None:
        ids = []
        for i in range(3):
            (tmp_path / str(i)).mkdir()
            ids.append(_create(client, auth, tmp_path / str(i)))
        client.post(f"/v1/runs/{ids[0]}/cancel", headers=auth)
        assert [_get(client, auth, i)["queue_position"] for i in ids] == [None, 1, 2]

        client.post(f"/v1/runs/{ids[0]}/resume", headers=auth)
        # Queue order is when a run (or its new attempt) was queued: a resumed run does not
        # jump ahead of younger runs that waited meanwhile.
        assert [_get(client, auth, i)["queue_position"] for i in ids] == [3, 1, 2]
