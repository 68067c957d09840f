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


def cancel_run(session: Session, run: Run, *, jobs: RayJobs | None) -> Run:
    """Queued → cancelled at once; live → cancelling, then cancelled once Ray confirms the
    stop (the reconciler watches). Repeating a cancel is harmless."""
    status = run.run_status
    if status in (RunStatus.CANCELLING, RunStatus.CANCELLED):
        return run
    if status.is_terminal():
        raise Conflict(f"run {run.id} is {status}; only a queued or live run can be cancelled")
    if status == RunStatus.QUEUED:
        set_status(session, run, RunStatus.CANCELLED, message="cancelled before it started")
        return run
    set_status(session, run, RunStatus.CANCELLING, message="cancel requested")
    if jobs is not None and run.ray_submission_id:
        try:
            jobs.stop(run.ray_submission_id)
        except RayUnavailable as exc:
            # The reconciler asks Ray again on its next pass.
            log.warning("run %s: could not reach Ray to stop the job yet: %s", run.id, exc)
    return run


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
