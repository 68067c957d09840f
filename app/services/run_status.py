"""The one function that changes a run's status, and the event log it writes."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from app.errors import InvalidTransition
from app.models import Event, Run, utcnow
from app.status import RunStatus, can_transition

log = logging.getLogger("tuneyard")


def record_event(
    session: Session, run: Run, *, type: str, message: str, status: str | None = None
) -> Event:
    event = Event(run_id=run.id, attempt=run.attempt, type=type, status=status, message=message)
    session.add(event)
    return event


def set_status(
    session: Session,
    run: Run,
    new: RunStatus,
    *,
    message: str = "",
    error_code: str | None = None,
    error_message: str | None = None,
) -> None:
    """Move `run` to `new`, or raise InvalidTransition; terminal states never change."""
    current = run.run_status
    if current == new:
        return
    if not can_transition(current, new):
        raise InvalidTransition(f"run {run.id} is {current}; it cannot become {new}")
    now = utcnow()
    run.status = new
    if new == RunStatus.RUNNING and run.started_at is None:
        run.started_at = now
    if new == RunStatus.QUEUED and current != RunStatus.STARTING:
        # A new attempt (resume, or a job Ray lost): the old one's outcome is history now.
        run.attempt += 1
        run.finished_at = None
        run.error_code = None
        run.error_message = None
        run.ray_submission_id = None
        run.callback_token_hash = None
    if new.is_terminal():
        run.finished_at = now
        # A finished run's worker has nothing more to say.
        run.callback_token_hash = None
    if error_code is not None or error_message is not None:
        run.error_code = error_code or "error"
        run.error_message = error_message or ""
    record_event(session, run, type="status", status=new, message=message or error_message or "")
    log.info("%s -> %s %s", current, new, message or error_message or "", extra={"run_id": run.id})
