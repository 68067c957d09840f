"""How a submission Ray refuses is read: a head that is not ready yet (its job agent not
started, as on a loaded machine's first minute) is retried; anything else fails the run.

A stand-in client raises what Ray's JobSubmissionClient raises: a dashboard that answers
500 with this message cannot be provoked on demand."""

from __future__ import annotations

from typing import Any

import pytest

from app.cluster.ray_jobs import RayJobs, RayRejected, RayUnavailable

# Ray 2.60's words (dashboard/modules/job/job_head.py), as its SDK's RuntimeError carries
# them; the first is what a run of this suite met on a loaded machine.
NOT_READY = [
    "Request failed with status code 500: No available agent to submit job, please try "
    "again later..",
    "Request failed with status code 500: Failed to get head node agent within 60 seconds. "
    "The last exception is KeyError('agent')",
]


class _Refusing:
    def __init__(self, message: str) -> None:
        self.message = message

    def submit_job(self, **_: Any) -> str:
        raise RuntimeError(self.message)


def _jobs(message: str) -> RayJobs:
    jobs = RayJobs("http://127.0.0.1:1")
    jobs._client = _Refusing(message)
    return jobs


@pytest.mark.parametrize("message", NOT_READY)
def test_a_head_whose_job_agent_is_not_ready_is_unavailable_not_a_rejection(message: str) -> None:
    with pytest.raises(RayUnavailable):
        _jobs(message).submit(
            submission_id="run_x-1", entrypoint="python -m worker", runtime_env={}
        )


def test_a_bad_runtime_env_is_a_rejection() -> None:
    message = "Request failed with status code 400: runtime_env: invalid pip spec."
    with pytest.raises(RayRejected):
        _jobs(message).submit(
            submission_id="run_x-1", entrypoint="python -m worker", runtime_env={}
        )
