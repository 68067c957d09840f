"""Runs: create, read and list. Services flush; the caller's transaction commits."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from pathlib import Path

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from app.errors import NotFound, ValidationFailed
from app.models import Run, new_id
from app.schemas.run_request import RunRequest
from app.services.path_rules import local_path_problems
from app.services.run_status import record_event
from app.status import RunStatus
from worker.data import is_local_source

MAX_PAGE = 100


def create_run(
    session: Session, *, request: RunRequest, owner_id: str | None, allowed_roots: list[Path]
) -> Run:
    problems = local_path_problems(request, allowed_roots=allowed_roots)
    if problems:
        raise ValidationFailed(problems)
    spec = request.worker_fields()
    # Workers run elsewhere, with another working directory: store absolute paths.
    if is_local_source(request.model):
        spec["model"] = str(Path(request.model).expanduser().resolve())
    if is_local_source(request.dataset.source):
        spec["dataset"]["source"] = str(Path(request.dataset.source).expanduser().resolve())
    run = Run(
        id=new_id("run"),
        owner_id=owner_id,
        status=RunStatus.QUEUED,
        attempt=1,
        spec=spec,
        run_metadata=dict(request.metadata),
        step=0,
        latest_metrics={},
    )
    session.add(run)
    session.flush()
    record_event(session, run, type="status", status=RunStatus.QUEUED, message="run created")
    return run


def get_run(session: Session, *, run_id: str, owner_id: str | None) -> Run:
    run = session.get(Run, run_id)
    # Another principal's run is indistinguishable from a missing one.
    if run is None or run.owner_id != owner_id:
        raise NotFound(f"run {run_id} not found")
    return run


def list_runs(
    session: Session,
    *,
    owner_id: str | None,
    status: RunStatus | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Run], str | None]:
    """Newest first. The cursor is the (created_at, id) of the last row seen, so pages stay
    correct while new runs are created in front of them."""
    query = select(Run).where(Run.owner_id == owner_id)
    if status is not None:
        query = query.where(Run.status == status)
    if cursor:
        created_at, run_id = _decode_cursor(cursor)
        query = query.where(
            or_(Run.created_at < created_at, and_(Run.created_at == created_at, Run.id < run_id))
        )
    limit = max(1, min(limit, MAX_PAGE))
    rows = list(
        session.scalars(query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit + 1))
    )
    next_cursor = _encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    return rows[:limit], next_cursor


def _encode_cursor(run: Run) -> str:
    raw = json.dumps([run.created_at.isoformat(), run.id])
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created_at, run_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return datetime.fromisoformat(created_at), str(run_id)
    except (ValueError, TypeError) as exc:
        raise ValidationFailed(
            [{"field": "cursor", "message": "cursor is not one this service issued"}]
        ) from exc
