"""What workers post back: status changes, metric batches and checkpoint records."""

from __future__ import annotations

import functools
from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from app.errors import Conflict, NotFound, Unauthorized
from app.models import Checkpoint, Metric, Run
from app.schemas.callbacks import CheckpointPost, MetricsPost, StatusPost
from app.security import secret_matches
from app.services import lifecycle
from app.services.lifecycle import Failure, record_event
from app.status import RunStatus


def authorize_worker(session: Session, *, run_id: str, token: str | None, attempt: int) -> Run:
    """A run's token is good for that run's current attempt only, and only while it is live."""
    run = session.get(Run, run_id, with_for_update=True)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    if (
        not token
        or run.callback_token_hash is None
        or not secret_matches(token, run.callback_token_hash)
    ):
        raise Unauthorized("invalid or expired run token")
    if attempt != run.attempt:
        raise Conflict(f"attempt {attempt} is over; run {run_id} is on attempt {run.attempt}")
    return run


def apply_status(session: Session, run: Run, post: StatusPost) -> None:
    failure = Failure(post.error.code, post.error.message) if post.error else None
    lifecycle.apply_worker_status(
        session, run, RunStatus(post.status), message=post.message or "", failure=failure
    )


@functools.cache
def _metric_insert(dialect: str) -> Any:
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    return insert(cast(Table, Metric.__table__)).on_conflict_do_nothing(
        index_elements=["run_id", "attempt", "name", "step"]
    )


def store_metrics(session: Session, run: Run, post: MetricsPost) -> int:
    """Idempotent: one row per (run, attempt, name, step), whatever is posted twice."""
    rows = [
        {
            "run_id": run.id,
            "attempt": run.attempt,
            "step": p.step,
            "name": p.name,
            "value": p.value,
            "time": p.time,
        }
        for p in post.points
    ]
    if rows:
        # One statement, the rows as parameters (executemany): `.values(rows)` would build
        # and compile a new multi-row statement for every batch, ~0.1 ms per point.
        session.connection().execute(_metric_insert(session.get_bind().dialect.name), rows)

    latest_step = max((p.step for p in post.points), default=None)
    if latest_step is not None and latest_step >= run.step:
        run.latest_metrics = {
            **run.latest_metrics,
            **{p.name: p.value for p in post.points if p.step == latest_step},
        }
    if post.progress is not None and post.progress.step >= run.step:
        run.step = post.progress.step
        run.total_steps = post.progress.total_steps
        run.epoch = post.progress.epoch
    return len(rows)


def store_checkpoint(session: Session, run: Run, post: CheckpointPost) -> Checkpoint:
    existing = session.scalar(
        select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.path == post.path)
    )
    if existing is not None:
        return existing
    checkpoint = Checkpoint(
        run_id=run.id,
        attempt=run.attempt,
        step=post.step,
        epoch=post.epoch,
        path=post.path,
        kind=post.kind,
        metrics=post.metrics,
    )
    session.add(checkpoint)
    if post.kind == "hf":
        run.model_path = post.path
        record_event(session, run, type="export", message=f"model exported to {post.path}")
    else:
        run.latest_checkpoint = post.path
        record_event(session, run, type="checkpoint", message=f"checkpoint at step {post.step}")
    session.flush()
    return checkpoint
