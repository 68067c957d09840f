"""How the worker talks to the tuneyard service: status, metrics and checkpoints, and the
scheduler's word on whether the attempt is to stop (worker/training/preemption.py).

Status and checkpoint posts are rare and matter, so they are sent synchronously with
retries. Metrics are frequent, so a background thread batches them from a bounded buffer:
a training step never waits on the network, and a service that is down for a while loses
nothing that fits in the buffer. Points that are lost anyway (refused by the service, or
pushed out of a full buffer) are counted and logged, and make the next `flush` say so.

Every body is one of contract/callbacks.py's models, which the service validates with the
same definitions: a field, a failure code or an event type cannot be misspelt on one side
only. A body this side cannot build is a bug: it is logged and not sent, as a body the
service refused would be, so the training it reports on never fails because of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from contract.callbacks import (
    CheckpointKind,
    CheckpointPost,
    EventPost,
    EventType,
    FailureCode,
    MetricsPost,
    StartupPhase,
    StatusPost,
    WorkerStatus,
)
from contract.job_env import CALLBACK_URL_ENV, TOKEN_ENV

log = logging.getLogger("tuneyard.worker")

# Enough for hours of per-step metrics of a handful of names; the oldest go first.
METRICS_BUFFER_POINTS = 200_000
METRICS_BATCH_POINTS = 2_000
# A read of /control that takes longer is given up: the poller asks again a few seconds
# later, and a service that is slow to answer must not hold the question up for long.
CONTROL_TIMEOUT_S = 3.0

Body = TypeVar("Body", bound=BaseModel)
_JSON = {"Content-Type": "application/json"}


class ServiceClient:
    def __init__(self, *, base_url: str, token: str, run_id: str, attempt: int) -> None:
        self.run_id = run_id
        self.attempt = attempt
        self._http = httpx.Client(
            base_url=f"{base_url.rstrip('/')}/v1/internal/runs/{run_id}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10.0,
        )
        # Whether the last read of /control failed (see `control`).
        self._control_failing = False

    @classmethod
    def from_env(cls, *, run_id: str, attempt: int) -> ServiceClient:
        """As every process of a job builds it: the callback address and the attempt's
        token come from the job's environment (contract/job_env.py)."""
        return cls(
            base_url=os.environ[CALLBACK_URL_ENV],
            token=os.environ[TOKEN_ENV],
            run_id=run_id,
            attempt=attempt,
        )

    def body(self, model: type[Body], **fields: Any) -> Body | None:
        """This attempt's `model`, or None (logged) when the fields break its rules."""
        try:
            return model(attempt=self.attempt, **fields)
        except ValidationError as exc:
            log.error("not sending a %s the service would refuse: %s", model.__name__, exc)
            return None

    def post(self, path: str, body: BaseModel | None, *, attempts: int = 5) -> bool:
        """POST with exponential backoff; False only when the service could not be reached.

        A 4xx answer is final (the run ended meanwhile, a bad body): it is logged and not
        retried, since sending it again cannot succeed.
        """
        return self.deliver(path, body, attempts=attempts) is not None

    def deliver(self, path: str, body: BaseModel | None, *, attempts: int = 5) -> int | None:
        """`post`, telling apart what the service took (2xx) from what it refused for good
        (3xx/4xx; 422 for a body that could not be built): the answer's status, or None when
        the service could not be reached."""
        if body is None:
            return 422
        # model_dump_json, not model_dump: only the JSON serializer writes non-finite floats
        # as the strings the service reads (`ser_json_inf_nan`).
        payload = body.model_dump_json(exclude_none=True)
        delay = 0.5
        for i in range(attempts):
            try:
                response = self._http.post(path, content=payload, headers=_JSON)
                if response.status_code < 500:
                    if not response.is_success:
                        # 3xx/4xx will not get better by retrying (e.g. the run ended).
                        log.warning(
                            "service refused %s: %s %s",
                            path,
                            response.status_code,
                            response.text[:300],
                        )
                    return response.status_code
            except httpx.HTTPError as exc:
                log.warning("posting %s failed: %s", path, exc)
            if i < attempts - 1:
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        return None

    def status(
        self,
        status: WorkerStatus,
        *,
        error: str | None = None,
        code: FailureCode = FailureCode.TRAINING_ERROR,
    ) -> bool:
        failure = {"code": code, "message": error} if error is not None else None
        return self.post("/status", self.body(StatusPost, status=status, error=failure), attempts=8)

    def checkpoint(
        self,
        *,
        step: int,
        epoch: float | None,
        path: str,
        kind: CheckpointKind,
        metrics: dict[str, float],
    ) -> bool:
        body = self.body(
            CheckpointPost, step=step, epoch=epoch, path=path, kind=kind, metrics=metrics
        )
        return self.post("/checkpoints", body)

    def event(self, type: EventType, message: str, *, attempts: int = 5) -> bool:
        return self.post(
            "/events", self.body(EventPost, type=type, message=message), attempts=attempts
        )

    def startup_phase(self, phase: StartupPhase, seconds: float, *, attempts: int = 1) -> bool:
        """One part of the attempt's start and its duration (worker/reporting/startup.py)."""
        body = self.body(
            EventPost,
            type=EventType.STARTUP_PHASE,
            message=f"{phase.value}: {seconds:.1f}s",
            phase=phase,
            duration_seconds=seconds,
        )
        return self.post("/events", body, attempts=attempts)

    def control(self) -> dict[str, Any] | None:
        """The scheduler's word on this attempt: `{"preempt": false}` or `{"preempt": true,
        "reason": "..."}`; None when it cannot be read (unreachable, slow, refused: 409 once
        the attempt is over, an answer of another shape).

        One try with a short timeout, and nothing raised: the caller is a poller that asks
        again soon, beside a training step that must never wait for the answer or fail
        because of it. Only a change between readable and unreadable is logged, so a
        service that is down for an hour writes two lines, not one per poll.
        """
        try:
            response = self._http.get(
                "/control", params={"attempt": self.attempt}, timeout=CONTROL_TIMEOUT_S
            )
            answer = response.json() if response.status_code == 200 else None
        # Any error, not only httpx's: the client may be closed under a poller that is
        # ending (RuntimeError), and a body may be no JSON (ValueError).
        except Exception as exc:
            self._control_unread(f"reading /control failed: {exc}")
            return None
        if response.status_code != 200:
            self._control_unread(
                f"service refused /control: {response.status_code} {response.text[:300]}"
            )
            return None
        if not isinstance(answer, dict) or not isinstance(answer.get("preempt"), bool):
            self._control_unread(f"unexpected answer from /control: {answer!r:.300}")
            return None
        if self._control_failing:
            log.info("/control answers again")
            self._control_failing = False
        return answer

    def _control_unread(self, why: str) -> None:
        if not self._control_failing:
            log.warning("%s (further failures are not logged until it answers)", why)
            self._control_failing = True

    def close(self) -> None:
        self._http.close()


class MetricsSender:
    """Batches metric points to the service from a daemon thread; `log` never blocks."""

    def __init__(self, client: ServiceClient, *, flush_interval_s: float = 1.0) -> None:
        self._client = client
        self._interval = flush_interval_s
        self._buffer: deque[dict[str, Any]] = deque(maxlen=METRICS_BUFFER_POINTS)
        self._progress: dict[str, Any] | None = None
        self._lock = threading.Lock()
        # Points lost since the last flush: refused by the service, or pushed out of a full
        # buffer. Under `_lock`.
        self._lost = 0
        # One send at a time, so a final flush in close() cannot overtake the thread's send.
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tuneyard-metrics", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], *, step: int, progress: dict[str, Any]) -> None:
        now = datetime.now(UTC).isoformat()
        # float() here, in the caller: a value that is no number fails where it was logged,
        # instead of in the sending thread with every point behind it.
        points = [
            {"step": step, "name": name, "value": float(value), "time": now}
            for name, value in metrics.items()
        ]
        with self._lock:
            # The deque drops its oldest points to take these: they count as lost.
            self._lost += max(0, len(self._buffer) + len(points) - METRICS_BUFFER_POINTS)
            self._buffer.extend(points)
            self._progress = progress

    def _take_batch(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        with self._lock:
            n = min(len(self._buffer), METRICS_BATCH_POINTS)
            batch = [self._buffer.popleft() for _ in range(n)]
            return batch, self._progress

    def _requeue(self, batch: list[dict[str, Any]]) -> None:
        with self._lock:
            self._buffer.extendleft(reversed(batch))

    def _send_pending(self, *, attempts: int) -> bool:
        with self._send_lock:
            return self._send_pending_locked(attempts=attempts)

    def _send_pending_locked(self, *, attempts: int) -> bool:
        while True:
            batch, progress = self._take_batch()
            if not batch:
                return True
            try:
                body = self._client.body(MetricsPost, points=batch, progress=progress)
                status = self._client.deliver("/metrics", body, attempts=attempts)
            except BaseException:
                self._requeue(batch)
                raise
            if status is None:
                self._requeue(batch)
                return False
            if status >= 300:
                # Refused for good (the attempt is over, a body the schema refuses): sending
                # it again cannot succeed, so it is counted as lost, not retried forever.
                with self._lock:
                    self._lost += len(batch)
                log.error("the service refused %d metric points (HTTP %d)", len(batch), status)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                self._send_pending(attempts=1)
            except Exception:
                # The thread must outlive a failed send: the batch went back to the buffer,
                # and the next round sends it again. Ending here would lose every later point.
                log.exception("sending metrics failed; trying again in %.1f s", self._interval)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver everything logged so far, now. False if the service did not take it all,
        or if points were lost since the last flush (refused, or out of a full buffer)."""
        deadline = time.monotonic() + timeout_s
        while not self._try_send():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        with self._lock:
            lost, self._lost = self._lost, 0
        if lost:
            log.error("%d metric points were lost since the last flush", lost)
        return lost == 0

    def _try_send(self) -> bool:
        try:
            return self._send_pending(attempts=1)
        except Exception:
            log.exception("sending metrics failed")
            return False

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop the thread and deliver what is left, trying for up to `timeout_s`: long
        enough to outlast a service restart, bounded so a service that is gone for good
        delays the end of training by two minutes at most (Ray's status settles the run)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._try_send():
                break
            time.sleep(1.0)
        with self._lock:
            lost = self._lost + len(self._buffer)
        if lost:
            log.warning("%d metric points undelivered", lost)
