"""worker/reporting/service_client.py against a real HTTP server on 127.0.0.1.

The server's port is bound before it listens, so a test can hold a service that refuses
connections (bound, not listening), one that hangs (listening, not answering) and one that
answers, on the same address, in that order.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from contract.callbacks import EventPost, EventType, FailureCode, MetricsPost, StatusPost
from worker.reporting.service_client import METRICS_BATCH_POINTS, MetricsSender, ServiceClient

RUN_ID = "run_42"
TOKEN = "secret-run-token"
# How long a flush or close may take to deliver to a local service that answers: an upper
# bound that only a loaded machine comes near.
SETTLE_S = 10


@dataclass(frozen=True)
class Received:
    path: str
    authorization: str | None
    body: dict[str, Any]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length))
        service = self.server.service
        status = service.next_status()
        service.record(Received(self.path, self.headers.get("Authorization"), body))
        payload = b"{}"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    service: RecordingService


class RecordingService:
    """Records every POST; answers with the queued statuses, then `default_status`."""

    def __init__(self) -> None:
        self._server = self._bind(0)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.statuses: deque[int] = deque()
        self.default_status = 200
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._listening = False
        self._thread: threading.Thread | None = None

    def _bind(self, port: int) -> _Server:
        server = _Server(("127.0.0.1", port), _Handler, bind_and_activate=False)
        server.service = self
        server.server_bind()
        return server

    def next_status(self) -> int:
        with self._lock:
            return self.statuses.popleft() if self.statuses else self.default_status

    def record(self, request: Received) -> None:
        with self._lock:
            self.received.append(request)

    def requests(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def listen(self) -> None:
        """Accept connections into the backlog without answering them: a hung service."""
        if not self._listening:
            self._server.server_activate()
            self._listening = True

    def serve(self) -> None:
        self.listen()
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def drop(self) -> None:
        """A hung service goes down: waiting connections are reset; the port stays reserved."""
        assert self._thread is None, "drop() is for a service that listens without serving"
        self._server.server_close()
        self._server = self._bind(self.port)
        self._listening = False

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


@pytest.fixture
def service() -> Iterator[RecordingService]:
    """Bound but not yet listening: connections are refused until a test calls serve()."""
    recording = RecordingService()
    yield recording
    recording.close()


@pytest.fixture
def client(service: RecordingService) -> Iterator[ServiceClient]:
    service_client = ServiceClient(
        base_url=service.url + "/", token=TOKEN, run_id=RUN_ID, attempt=3
    )
    yield service_client
    service_client.close()


def wait_until(condition: Callable[[], bool], *, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def delivered_points(service: RecordingService) -> list[dict[str, Any]]:
    return [
        point
        for request in service.requests()
        if request.path.endswith("/metrics")
        for point in request.body["points"]
    ]


class TestServiceClientPost:
    def test_sends_the_bearer_token_and_the_attempt(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.serve()

        assert client.post("/status", client.body(StatusPost, status="running"), attempts=1) is True

        assert service.requests() == [
            Received(
                path=f"/v1/internal/runs/{RUN_ID}/status",
                authorization=f"Bearer {TOKEN}",
                body={"attempt": 3, "status": "running"},
            )
        ]

    def test_retries_a_5xx_until_it_succeeds(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.statuses.extend([503, 502])
        service.serve()

        assert client.post("/metrics", client.body(MetricsPost, points=[]), attempts=3) is True

        requests = service.requests()
        assert len(requests) == 3
        assert all(r.body == {"attempt": 3, "points": []} for r in requests)

    def test_gives_up_after_the_given_attempts_of_5xx(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.default_status = 500
        service.serve()

        assert (
            client.post("/status", client.body(StatusPost, status="running"), attempts=2) is False
        )
        assert len(service.requests()) == 2

    def test_retries_when_the_connection_is_refused(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        # The first try is refused; the service comes up during the 0.5 s backoff.
        timer = threading.Timer(0.2, service.serve)
        timer.start()
        try:
            assert (
                client.post("/status", client.body(StatusPost, status="running"), attempts=2)
                is True
            )
        finally:
            timer.join()

        assert [r.body for r in service.requests()] == [{"attempt": 3, "status": "running"}]

    def test_gives_up_when_the_service_stays_unreachable(self, client: ServiceClient) -> None:
        started = time.monotonic()

        assert (
            client.post("/status", client.body(StatusPost, status="running"), attempts=2) is False
        )

        # It did wait to retry (the first backoff is 0.5 s), and then stopped.
        assert 0.4 <= time.monotonic() - started < 3

    @pytest.mark.parametrize("status", [400, 404, 409, 422])
    def test_a_4xx_is_final(
        self, service: RecordingService, client: ServiceClient, status: int
    ) -> None:
        service.statuses.append(status)
        service.serve()
        started = time.monotonic()

        assert client.post("/status", client.body(StatusPost, status="running"), attempts=3) is True

        assert time.monotonic() - started < 0.4
        assert len(service.requests()) == 1

    def test_status_with_an_error_and_checkpoint_bodies(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.serve()

        assert (
            client.status("failed", error="CUDA out of memory", code=FailureCode.CLUSTER_ERROR)
            is True
        )
        assert client.checkpoint(
            step=10, epoch=0.5, path="/s/ckpt", kind="deepspeed", metrics={"loss": 1.5}
        )

        first, second = service.requests()
        assert first.path.endswith("/status")
        assert first.body == {
            "attempt": 3,
            "status": "failed",
            "error": {"code": "cluster_error", "message": "CUDA out of memory"},
        }
        assert second.path.endswith("/checkpoints")
        assert second.body == {
            "attempt": 3,
            "step": 10,
            "epoch": 0.5,
            "path": "/s/ckpt",
            "kind": "deepspeed",
            "metrics": {"loss": 1.5},
        }

    def test_a_body_the_service_would_refuse_is_not_sent(
        self, service: RecordingService, client: ServiceClient, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The worker builds the service's own models (contract/callbacks.py): a body that
        breaks their rules is logged where it is made, and never reaches the wire."""
        caplog.set_level(logging.ERROR, logger="tuneyard.worker")
        service.serve()

        assert client.checkpoint(step=-1, epoch=None, path="/s/c", kind="hf", metrics={})
        assert client.post("/events", client.body(EventPost, type="no_such_event", message=""))
        # The service's own event types are not the worker's to post.
        assert client.event(EventType.STATUS, "queued") is True
        assert client.event(EventType.RESUMED, "attempt 2: resumed from step 3") is True

        [sent] = service.requests()
        assert sent.body == {
            "attempt": 3,
            "type": "resumed",
            "message": "attempt 2: resumed from step 3",
        }
        assert caplog.text.count("not sending a") == 3


class TestMetricsSender:
    def test_points_logged_while_the_service_is_down_arrive_once_in_order(
        self, service: RecordingService, client: ServiceClient, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="tuneyard.worker")
        sender = MetricsSender(client, flush_interval_s=0.05)
        try:
            for step in range(1, 6):
                sender.log({"loss": 1.0 / step, "lr": 0.001}, step=step, progress={"step": step})
            # Let the sender fail a few flushes against the refused port.
            assert wait_until(lambda: "posting /metrics failed" in caplog.text)
            time.sleep(0.15)
            for step in range(6, 11):
                sender.log({"loss": 1.0 / step, "lr": 0.001}, step=step, progress={"step": step})
            assert service.requests() == []

            service.serve()
            assert wait_until(lambda: len(delivered_points(service)) >= 20)
            time.sleep(0.2)  # a duplicate would arrive in the next flushes
        finally:
            sender.close(timeout_s=SETTLE_S)

        points = delivered_points(service)
        assert [(p["step"], p["name"], p["value"]) for p in points] == [
            (step, name, value)
            for step in range(1, 11)
            for name, value in (("loss", 1.0 / step), ("lr", 0.001))
        ]
        requests = service.requests()
        assert all(r.authorization == f"Bearer {TOKEN}" for r in requests)
        assert requests[-1].body["progress"] == {"step": 10}

    def test_log_returns_at_once_while_the_service_hangs(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.listen()  # connections are accepted, never answered
        sender = MetricsSender(client, flush_interval_s=0.05)
        try:
            sender.log({"loss": 2.0}, step=1, progress={"step": 1})
            time.sleep(0.3)  # the sender is now waiting on the hung service (10 s timeout)

            started = time.monotonic()
            for step in range(2, 502):
                sender.log({"loss": 2.0, "lr": 0.1}, step=step, progress={"step": step})
            assert time.monotonic() - started < 1.0
            assert service.requests() == []

            service.serve()  # the hung request is answered, then the rest follows
            assert wait_until(lambda: len(delivered_points(service)) >= 1001)
        finally:
            sender.close(timeout_s=SETTLE_S)

        steps = [p["step"] for p in delivered_points(service)]
        assert steps == [1] + [step for step in range(2, 502) for _ in range(2)]

    def test_points_logged_during_a_failed_send_keep_their_order(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        """A batch that fails goes back before the points logged while it was in flight."""
        service.listen()
        sender = MetricsSender(client, flush_interval_s=0.05)
        try:
            sender.log({"loss": 3.0}, step=1, progress={"step": 1})
            time.sleep(0.3)  # step 1 is in flight to the hung service
            for step in range(2, 6):
                sender.log({"loss": 3.0}, step=step, progress={"step": step})
            service.drop()  # the request in flight fails
            time.sleep(0.2)
            assert service.requests() == []

            service.serve()
            assert wait_until(lambda: len(delivered_points(service)) >= 5)
            time.sleep(0.2)  # a duplicate would arrive in the next flushes
        finally:
            sender.close(timeout_s=SETTLE_S)

        assert [p["step"] for p in delivered_points(service)] == [1, 2, 3, 4, 5]

    def test_close_flushes_what_is_left(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.serve()
        sender = MetricsSender(client, flush_interval_s=60)
        for step in range(1, 4):
            sender.log({"loss": float(step)}, step=step, progress={"step": step, "total_steps": 3})
        time.sleep(0.1)
        assert service.requests() == []  # nothing is due before the flush interval

        sender.close(timeout_s=SETTLE_S)

        assert [(p["step"], p["value"]) for p in delivered_points(service)] == [
            (1, 1.0),
            (2, 2.0),
            (3, 3.0),
        ]
        assert service.requests()[-1].body["progress"] == {"step": 3, "total_steps": 3}

    def test_large_backlogs_go_in_bounded_batches_in_order(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        sender = MetricsSender(client, flush_interval_s=60)
        total = METRICS_BATCH_POINTS * 2 + 7
        for step in range(total):
            sender.log({"loss": float(step)}, step=step, progress={"step": step})
        service.serve()

        sender.close(timeout_s=SETTLE_S)

        sizes = [len(r.body["points"]) for r in service.requests()]
        assert sizes == [METRICS_BATCH_POINTS, METRICS_BATCH_POINTS, 7]
        assert [p["step"] for p in delivered_points(service)] == list(range(total))


class TestNonFiniteValuesAndLostPoints:
    """A diverging run (NaN, ±Infinity) keeps reporting; a point lost is never silent."""

    def test_nonfinite_values_go_as_the_strings_the_service_reads(
        self, service: RecordingService, client: ServiceClient
    ) -> None:
        service.serve()
        nan, inf = float("nan"), float("inf")

        assert client.checkpoint(
            step=1, epoch=0.5, path="/s/c", kind="deepspeed", metrics={"loss": nan, "g": -inf}
        )
        sender = MetricsSender(client, flush_interval_s=60)
        try:
            sender.log({"loss": nan, "grad_norm": inf, "lr": 0.1}, step=2, progress={"step": 2})
            assert sender.flush(timeout_s=SETTLE_S) is True
        finally:
            sender.close(timeout_s=SETTLE_S)

        checkpoint, metrics = service.requests()
        assert checkpoint.body["metrics"] == {"loss": "NaN", "g": "-Infinity"}
        assert [(p["name"], p["value"]) for p in metrics.body["points"]] == [
            ("loss", "NaN"),
            ("grad_norm", "Infinity"),
            ("lr", 0.1),
        ]

    def test_the_thread_outlives_a_send_that_raises(
        self,
        service: RecordingService,
        client: ServiceClient,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Anything a send raises (not only a network error) leaves the thread running,
        and the batch in the buffer: the next round delivers it, with no flush."""
        caplog.set_level(logging.ERROR, logger="tuneyard.worker")
        service.serve()
        real_post = client._http.post
        failures = [RuntimeError("encoder bug")]

        def post_failing_once(*args: Any, **kwargs: Any) -> Any:
            if failures:
                raise failures.pop()
            return real_post(*args, **kwargs)

        monkeypatch.setattr(client._http, "post", post_failing_once)
        sender = MetricsSender(client, flush_interval_s=0.05)
        try:
            sender.log({"loss": 1.0}, step=1, progress={"step": 1})
            assert wait_until(lambda: not failures)
            sender.log({"loss": 0.5}, step=2, progress={"step": 2})
            assert wait_until(lambda: len(delivered_points(service)) >= 2)
        finally:
            sender.close(timeout_s=SETTLE_S)

        assert [p["step"] for p in delivered_points(service)] == [1, 2]
        assert "encoder bug" in caplog.text

    @pytest.mark.parametrize("status", [401, 409, 422])
    def test_flush_is_false_when_the_service_refused_points(
        self,
        service: RecordingService,
        client: ServiceClient,
        status: int,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.ERROR, logger="tuneyard.worker")
        service.statuses.append(status)
        service.serve()
        sender = MetricsSender(client, flush_interval_s=60)
        try:
            sender.log({"loss": 1.0, "lr": 0.1}, step=1, progress={"step": 1})
            assert sender.flush(timeout_s=SETTLE_S) is False
            assert "refused 2 metric points" in caplog.text
            # Reported once; what follows is delivered and flushed as usual.
            sender.log({"loss": 0.9}, step=2, progress={"step": 2})
            assert sender.flush(timeout_s=SETTLE_S) is True
        finally:
            sender.close(timeout_s=SETTLE_S)
        assert len(service.requests()) == 2

    def test_flush_is_false_when_a_full_buffer_dropped_points(
        self, service: RecordingService, client: ServiceClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("worker.reporting.service_client.METRICS_BUFFER_POINTS", 5)
        sender = MetricsSender(client, flush_interval_s=60)
        try:
            for step in range(1, 9):  # the service is down: 8 points into a buffer of 5
                sender.log({"loss": float(step)}, step=step, progress={"step": step})
            service.serve()
            assert sender.flush(timeout_s=SETTLE_S) is False
        finally:
            sender.close(timeout_s=SETTLE_S)
        # The newest five arrived; the oldest three were lost, and flush said so.
        assert [p["step"] for p in delivered_points(service)] == [4, 5, 6, 7, 8]

    def test_a_value_that_is_no_number_fails_where_it_is_logged(
        self, client: ServiceClient
    ) -> None:
        sender = MetricsSender(client, flush_interval_s=60)
        try:
            with pytest.raises(TypeError):
                sender.log({"loss": object()}, step=1, progress={"step": 1})  # type: ignore[dict-item]
        finally:
            sender.close(timeout_s=0)


def test_a_resume_is_recorded_through_a_slow_moment(
    service: RecordingService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The `resumed` event is how users (and the fault-tolerance test) see a restart from a
    # checkpoint: one try lost it whenever the service answered 503 for a moment.
    from contract.job_env import CALLBACK_URL_ENV, TOKEN_ENV
    from contract.run_request import RunSpec
    from worker.reporting.metrics import MetricSinks

    monkeypatch.setenv(CALLBACK_URL_ENV, service.url + "/")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    spec = RunSpec.model_validate(
        {
            "run_id": RUN_ID,
            "attempt": 2,
            "storage_path": "/unused",
            "model": "gpt2",
            "dataset": {"source": "ag_news"},
        }
    )
    service.statuses.extend([503, 503])
    service.serve()
    sinks = MetricSinks(spec, rank=0)
    try:
        sinks.record("resumed", "attempt 2: resumed from the checkpoint at step 20")
    finally:
        sinks.close(failed=False)

    events = [r.body for r in service.requests() if r.path.endswith("/events")]
    assert [e["type"] for e in events] == ["resumed"] * 3
