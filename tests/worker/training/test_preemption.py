"""Preemption on the worker (worker/training/preemption.py, the training loop, the job driver).

The service is a real HTTP server on 127.0.0.1 (tests/worker/reporting/test_service_client.py's
RecordingService, which also answers GET .../control here). A whole preemption, on the
real service and a real Ray cluster with 2 DeepSpeed workers, checkpointed where both
ranks stopped and resumed with every step's loss equal to an uninterrupted run's, is
tests/e2e/test_shared_cluster.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from contract.job_env import CONTROL_POLL_ENV
from tests.worker.reporting.test_service_client import (
    RUN_ID,
    TOKEN,
    Received,
    RecordingService,
    _Handler,
    _Server,
    wait_until,
)
from worker.reporting import service_client
from worker.reporting.service_client import ServiceClient
from worker.training.preemption import (
    DEFAULT_POLL_S,
    ControlPoller,
    Preempted,
    Preemption,
    poll_interval_s,
    preempted_in,
)

CONTROL_PATH = f"/v1/internal/runs/{RUN_ID}/control?attempt=3"
NOT_NOW = (200, {"preempt": False})


class _ControlHandler(_Handler):
    def do_GET(self) -> None:
        service: ControlService = self.server.service  # type: ignore[assignment]
        request = Received(self.path, self.headers.get("Authorization"), {})
        service.record(request)
        status, answer = service.answer(request)
        payload = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class ControlService(RecordingService):
    """RecordingService that also answers GET .../control: with the queued answers, then
    with `control(request)` (not now, unless a test says otherwise)."""

    def __init__(self) -> None:
        self.answers: deque[tuple[int, Any]] = deque()
        self.control: Callable[[Received], tuple[int, Any]] = lambda request: NOT_NOW
        super().__init__()

    def _bind(self, port: int) -> _Server:
        server = _Server(("127.0.0.1", port), _ControlHandler, bind_and_activate=False)
        server.service = self
        server.server_bind()
        return server

    def answer(self, request: Received) -> tuple[int, Any]:
        with self._lock:
            if self.answers:
                return self.answers.popleft()
        return self.control(request)

    def control_reads(self) -> list[Received]:
        return [r for r in self.requests() if "/control" in r.path]


@pytest.fixture
def service() -> Iterator[ControlService]:
    """Bound but not yet listening: connections are refused until a test calls serve()."""
    control = ControlService()
    yield control
    control.close()


@pytest.fixture
def client(service: ControlService) -> Iterator[ServiceClient]:
    service_client = ServiceClient(base_url=service.url, token=TOKEN, run_id=RUN_ID, attempt=3)
    yield service_client
    service_client.close()


class TestServiceClientControl:
    def test_reads_the_attempts_control_with_the_run_token(
        self, service: ControlService, client: ServiceClient
    ) -> None:
        service.answers.append((200, {"preempt": True, "reason": "run_high needs 2 CPUs"}))
        service.serve()

        assert client.control() == {"preempt": True, "reason": "run_high needs 2 CPUs"}
        assert client.control() == {"preempt": False}
        assert service.requests() == [
            Received(CONTROL_PATH, f"Bearer {TOKEN}", {}),
            Received(CONTROL_PATH, f"Bearer {TOKEN}", {}),
        ]

    @pytest.mark.parametrize("status", [401, 409, 500, 503])
    def test_a_refusal_is_none_after_one_try(
        self, service: ControlService, client: ServiceClient, status: int
    ) -> None:
        service.answers.append((status, {"detail": "no"}))
        service.serve()

        assert client.control() is None
        assert len(service.requests()) == 1

    @pytest.mark.parametrize(
        "body", [b"not json", [True], {"preempt": "yes"}, {"reason": "no flag"}], ids=str
    )
    def test_an_answer_of_another_shape_is_none(
        self, service: ControlService, client: ServiceClient, body: Any
    ) -> None:
        service.answers.append((200, body))
        service.serve()

        assert client.control() is None

    def test_an_unreachable_service_is_none_at_once(self, client: ServiceClient) -> None:
        started = time.monotonic()
        assert client.control() is None  # bound, not listening: refused
        assert time.monotonic() - started < 1.0

    def test_a_hung_service_is_none_after_the_short_timeout(
        self, service: ControlService, client: ServiceClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(service_client, "CONTROL_TIMEOUT_S", 0.3)
        service.listen()  # accepts, never answers

        started = time.monotonic()
        assert client.control() is None
        assert 0.25 <= time.monotonic() - started < 2.0

    def test_a_closed_client_is_none_not_an_error(
        self, service: ControlService, client: ServiceClient
    ) -> None:
        """The poller may read once more while the rank is closing its client."""
        service.serve()
        client.close()

        assert client.control() is None

    def test_failures_are_logged_once_until_it_answers_again(
        self, service: ControlService, client: ServiceClient, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="tuneyard.worker")
        service.answers.extend([(503, {}), (503, {}), (503, {}), NOT_NOW, (409, {})])
        service.serve()

        results = [client.control() for _ in range(5)]

        assert results == [None, None, None, {"preempt": False}, None]
        messages = [r.getMessage() for r in caplog.records if r.name == "tuneyard.worker"]
        assert [m.split(":")[0] for m in messages] == [
            "service refused /control",
            "/control answers again",
            "service refused /control",
        ]


class TestPollInterval:
    def test_absent_is_the_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(CONTROL_POLL_ENV, raising=False)
        assert poll_interval_s() == DEFAULT_POLL_S == 5.0

    def test_the_dispatchers_value(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CONTROL_POLL_ENV, "0.25")
        assert poll_interval_s() == 0.25

    @pytest.mark.parametrize("raw", ["", "soon", "0", "-1", "nan", "inf"])
    def test_a_value_that_is_no_positive_number_is_the_default(
        self, monkeypatch: pytest.MonkeyPatch, raw: str
    ) -> None:
        monkeypatch.setenv(CONTROL_POLL_ENV, raw)
        assert poll_interval_s() == DEFAULT_POLL_S


class TestControlPoller:
    def test_raises_the_flag_with_the_reason_and_stops_asking(
        self, service: ControlService, client: ServiceClient
    ) -> None:
        service.answers.extend([NOT_NOW, NOT_NOW, (200, {"preempt": True, "reason": "r_high"})])
        service.serve()
        poller = ControlPoller(client, interval_s=0.05)
        try:
            assert wait_until(lambda: poller.requested)
            assert poller.reason == "r_high"
            time.sleep(0.3)  # six more polls, were it still polling
        finally:
            poller.close()
        assert len(service.control_reads()) == 3

    def test_keeps_asking_through_failures(
        self, service: ControlService, client: ServiceClient
    ) -> None:
        service.answers.extend([(500, {}), (409, {}), (200, b"garbage"), (200, {"preempt": True})])
        poller = ControlPoller(client, interval_s=0.05)
        try:
            time.sleep(0.2)  # refused meanwhile: the service is not listening yet
            assert not poller.requested
            service.serve()
            assert wait_until(lambda: poller.requested)
        finally:
            poller.close()
        assert poller.reason is None
        assert len(service.control_reads()) == 4

    def test_close_stops_the_polling(self, service: ControlService, client: ServiceClient) -> None:
        service.serve()
        poller = ControlPoller(client, interval_s=0.05)
        assert wait_until(lambda: len(service.control_reads()) >= 2)
        poller.close()
        time.sleep(0.1)  # a read in flight when it closed may still land
        reads = len(service.control_reads())
        time.sleep(0.3)
        assert len(service.control_reads()) == reads
        assert not poller.requested

    def test_one_process_votes_its_own_flag(
        self, service: ControlService, client: ServiceClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without a process group (one rank), the vote is rank 0's flag."""
        monkeypatch.setenv(CONTROL_POLL_ENV, "0.05")
        service.serve()
        preemption = Preemption(attempt=3, client=client, group=None)
        try:
            assert wait_until(lambda: len(service.control_reads()) >= 1)
            assert preemption.agreed() is False  # not now
            service.control = lambda request: (200, {"preempt": True, "reason": "r_high"})
            assert wait_until(lambda: preemption.reason is not None)
            assert preemption.agreed() is True
            assert preemption.marker() == {
                "preempted": 1,
                "preempted_attempt": 3,
                "preempted_reason": "r_high",
            }
        finally:
            preemption.close()
        # A rank without a client never polls and adds no reason.
        other = Preemption(attempt=3, client=None, group=None)
        assert other.agreed() is False
        assert other.marker() == {"preempted": 1, "preempted_attempt": 3}


class TestPreemptedIn:
    def test_reads_the_marker_of_this_attempt(self) -> None:
        metrics = {"loss": 2.0, "step": 7, "preempted": 1, "preempted_attempt": 2}
        assert preempted_in(metrics, attempt=2) == Preempted(step=7)
        assert preempted_in({**metrics, "preempted_reason": "r"}, attempt=2) == Preempted(7, "r")

    def test_a_predecessors_marker_or_none_is_no_preemption(self) -> None:
        metrics = {"loss": 2.0, "step": 7, "preempted": 1, "preempted_attempt": 1}
        assert preempted_in(metrics, attempt=2) is None
        assert preempted_in({"loss": 2.0, "step": 7}, attempt=1) is None
        assert preempted_in(None, attempt=1) is None

    def test_the_event_message(self) -> None:
        assert Preempted(12, "run_b (priority 5) needs 2 GPUs").message == (
            "checkpoint at step 12; stopped for the scheduler: run_b (priority 5) needs 2 GPUs"
        )
        assert Preempted(12).message == "checkpoint at step 12; stopped for the scheduler"
