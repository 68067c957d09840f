"""Cancel and resume: what a client may do to a run after creating it."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from app.errors import Conflict
from app.models import Run
from app.ray_jobs import RayJobs, RayUnavailable
from app.services.run_status import set_status
from app.status import RunStatus

log = logging.getLogger("tuneyard")


def cancel_run(session: Session, run: Run) -> str | None:
    """Queued → cancelled at once; live → cancelling, then cancelled once Ray confirms the
    stop (the reconciler watches). Repeating a cancel is harmless. Returns the Ray job the
    caller should stop once this is committed, if any."""
    status = run.run_status
    if status in (RunStatus.CANCELLING, RunStatus.CANCELLED):
        return None
    if status.is_terminal():
        raise Conflict(f"run {run.id} is {status}; only a queued or live run can be cancelled")
    if status == RunStatus.QUEUED:
        set_status(session, run, RunStatus.CANCELLED, message="cancelled before it started")
        return None
    set_status(session, run, RunStatus.CANCELLING, message="cancel requested")
    return run.ray_submission_id


def stop_job(jobs: RayJobs, submission_id: str) -> None:
    try:
        jobs.stop(submission_id)
    except RayUnavailable as exc:
        # The reconciler asks Ray again on its next pass.
        log.warning("could not reach Ray to stop job %s yet: %s", submission_id, exc)


def resume_run(session: Session, run: Run) -> Run:
    """A failed or cancelled run starts a new attempt under the same Ray Train storage name,
    so Ray Train picks up its latest checkpoint and the step count continues."""
    status = run.run_status
    if status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        raise Conflict(f"run {run.id} is {status}; only a failed or cancelled run can be resumed")
    set_status(
        session, run, RunStatus.QUEUED, message=f"resumed by request: attempt {run.attempt + 1}"
    )
    return run
