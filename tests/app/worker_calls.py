"""What the worker of a dispatched run sends the service: the headers it posts with, its
status reports and its reads of the control endpoint.

The worker's only credential is the callback token the dispatcher put in its job's
runtime_env (contract/job_env.py); the tests read it from the job the recording Ray
received, as the worker reads it from its environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from fastapi.testclient import TestClient

from app.settings import Settings
from contract.job_env import TOKEN_ENV

Headers = dict[str, str]


class RecordingRay(Protocol):
    """A stand-in for Ray that keeps the jobs it was given (test_dispatch.ScriptedRay);
    a protocol, because test_dispatch itself uses these helpers."""

    @property
    def submitted(self) -> Sequence[Mapping[str, Any]]: ...


class Reply(Protocol):
    """What the tests read of the service's answer. The TestClient's response class is
    httpx's or, under a Starlette that finds httpx2 installed, httpx2's: neither is named."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self, **kwargs: Any) -> Any: ...


def job_token(job: Mapping[str, Any]) -> str:
    """The callback token in a submitted job's environment."""
    return str(job["runtime_env"]["env_vars"][TOKEN_ENV])


def bearer(token: str) -> Headers:
    """The headers a worker holding `token` posts with."""
    return {"Authorization": f"Bearer {token}"}


def worker_headers(ray: RecordingRay, run_id: str | None = None, attempt: int = 1) -> Headers:
    """The headers the worker of a job on `ray` posts with: the job submitted last, or, with
    `run_id`, the last job of that run's `attempt` (a resubmitted attempt has a new token)."""
    jobs = [
        job
        for job in ray.submitted
        if run_id is None or job["submission_id"] == f"{run_id}-{attempt}"
    ]
    assert jobs, f"no job was submitted for {run_id}-{attempt}" if run_id else "no job submitted"
    return bearer(job_token(jobs[-1]))


def post_status(
    client: TestClient,
    run_id: str,
    worker: Headers,
    status: str,
    *,
    attempt: int = 1,
    check: bool = False,
    **extra: Any,
) -> Reply:
    """POST the worker's status report {"attempt", "status", **extra} (e.g. `error`);
    `check`: assert the service took it (200). A failure without an `error` given carries a
    training error, as the worker's always does (the service refuses one without)."""
    if status == "failed":
        extra.setdefault("error", {"code": "training_error", "message": "it failed"})
    response = client.post(
        f"/v1/internal/runs/{run_id}/status",
        json={"attempt": attempt, "status": status, **extra},
        headers=worker,
    )
    if check:
        assert response.status_code == 200, response.text
    return response


def run_location(settings: Settings, run_id: str, *parts: str) -> str:
    """A location in the run's folder in storage (storage/<run id>/...), where its worker
    writes checkpoints and exports: the only place whose locations the service records."""
    return settings.storage.join(run_id, *parts)


def control(client: TestClient, run_id: str, worker: Headers, attempt: int = 1) -> Reply:
    """GET what the scheduler asks of the worker's attempt (whether to stop: preemption)."""
    return client.get(
        f"/v1/internal/runs/{run_id}/control", params={"attempt": attempt}, headers=worker
    )
