"""What workers post back: status changes, metric batches and checkpoint records."""

from __future__ import annotations

import functools
import hmac
from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from app.errors import Conflict, Unauthorized, ValidationFailed, field_problem
from app.schemas.run_view import CheckpointView, nonfinite_kind, stored_metric_value
from app.security import hash_secret, secret_matches
from app.services import lifecycle, run_result
from app.services.lifecycle import Failure, record_event
from app.services.rules.path_rules import export_problem, run_location
from app.services.rules.webhook_rules import WebhookConfig
from app.services.webhooks import enqueue_webhooks
from app.storage.models import RUN_ID, Checkpoint, Event, Metric, Run, is_minted
from contract.callbacks import CheckpointPost, EventType, MetricsPost, StatusPost
from contract.statuses import RunStatus
from contract.storage import Storage

_BAD_TOKEN = "invalid or expired run token"

# What a token is compared with when the run is unknown or has no live token: the
# comparison still happens, so the answer's timing does not tell which runs exist.
_NO_TOKEN_HASH = hash_secret("tuneyard: no run token")


def read_token_hash(session: Session, *, run_id: str) -> str | None:
    """The hash of the run's live token; None for an unknown or finished run."""
    if not is_minted(RUN_ID, run_id):  # no run has it; PostgreSQL may refuse it (a NUL)
        return None
    return session.scalar(select(Run.callback_token_hash).where(Run.id == run_id))


def verify_token(token: str | None, token_hash: str | None) -> str:
    """The hash `token` matched. Compared in constant time, and refused alike for a missing
    token, a wrong one and a run that does not exist (or has no live token)."""
    matches = secret_matches(token or "", token_hash or _NO_TOKEN_HASH)
    if not matches or token is None or token_hash is None:
        raise Unauthorized(_BAD_TOKEN)
    return token_hash


def authorize_worker(
    session: Session, *, run_id: str, token_hash: str, attempt: int, lock: bool = True
) -> Run:
    """The run, locked for this request's write, once `verify_token` accepted the token in
    a read of its own (before this write session, and SQLite's write lock, were taken).
    Checked again under the lock: a new attempt, or the run's end, may have replaced the
    token meanwhile. `lock=False`: for a request that only reads (in a read session).

    A run's token is good for that run's current attempt only, and only while it is live.
    """
    run = session.get(Run, run_id, with_for_update=lock)
    if (
        run is None
        or run.callback_token_hash is None
        or not hmac.compare_digest(token_hash, run.callback_token_hash)
    ):
        raise Unauthorized(_BAD_TOKEN)
    if attempt != run.attempt:
        raise Conflict(f"attempt {attempt} is over; run {run_id} is on attempt {run.attempt}")
    return run


def apply_status(session: Session, run: Run, post: StatusPost, *, hooks: WebhookConfig) -> None:
    failure = Failure(post.error.code, post.error.message) if post.error else None
    lifecycle.apply_worker_status(
        session,
        run,
        RunStatus(post.status),
        message=post.message or "",
        failure=failure,
        hooks=hooks,
    )


@functools.cache
def _metric_insert(dialect: str) -> Any:
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    return insert(cast(Table, Metric.__table__)).on_conflict_do_nothing(
        index_elements=["run_id", "attempt", "name", "step"]
    )


def store_metrics(session: Session, run: Run, post: MetricsPost) -> int:
    """Idempotent: one row per (run, attempt, name, step), whatever is posted twice.

    A value that is not a finite number is stored as NULL with `nonfinite` saying which:
    SQLite's REAL turns NaN into NULL anyway, and JSON (`latest_metrics`) holds neither."""
    rows = []
    for p in post.points:
        kind = nonfinite_kind(p.value)
        rows.append(
            {
                "run_id": run.id,
                "attempt": run.attempt,
                "step": p.step,
                "name": p.name,
                "value": None if kind else p.value,
                "nonfinite": kind,
                "time": p.time,
            }
        )
    if rows:
        # One statement, the rows as parameters (executemany): `.values(rows)` would build
        # and compile a new multi-row statement for every batch, ~0.1 ms per point.
        session.connection().execute(_metric_insert(session.get_bind().dialect.name), rows)

    latest_step = max((p.step for p in post.points), default=None)
    if latest_step is not None and latest_step >= run.step:
        run.latest_metrics = {
            **run.latest_metrics,
            **{p.name: stored_metric_value(p.value) for p in post.points if p.step == latest_step},
        }
    if post.progress is not None and post.progress.step >= run.step:
        run.step = post.progress.step
        run.total_steps = post.progress.total_steps
        run.epoch = post.progress.epoch
    return len(rows)


def checked_location(storage: Storage, *, run_id: str, post: CheckpointPost) -> CheckpointPost:
    """`post`, its path normalized, once that path is the run's own (under storage/<run id>/,
    app/services/rules/path_rules.py); else ValidationFailed naming `path`. Blocking: a local
    path's links are followed. A run's model download and a later `model: <run id>` read
    what is recorded here, so nothing outside the run's folder may be."""
    location, message = run_location(storage, run_id, post.path)
    if location is None:
        raise ValidationFailed([field_problem("path", f"the {post.kind} location {message}")])
    if post.kind in ("hf", "adapter") and (problem := export_problem(location)):
        raise ValidationFailed([field_problem("path", f"the {post.kind} export: {problem}")])
    return post.model_copy(update={"path": location})


def startup_phase_of(session: Session, run: Run, *, phase: str | None) -> Event | None:
    """The run's current attempt's `startup_phase` event for `phase`, if it has one."""
    return session.scalar(
        select(Event)
        .where(
            Event.run_id == run.id,
            Event.attempt == run.attempt,
            Event.type == EventType.STARTUP_PHASE,
            Event.phase == phase,
        )
        .limit(1)
    )


def store_checkpoint(
    session: Session, run: Run, post: CheckpointPost, *, hooks: WebhookConfig
) -> Checkpoint:
    """Records a checkpoint or export whose location `checked_location` accepted."""
    existing = session.scalar(
        select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.path == post.path)
    )
    if existing is not None:
        return existing
    metrics = {name: stored_metric_value(value) for name, value in post.metrics.items()}
    checkpoint = Checkpoint(
        run_id=run.id,
        attempt=run.attempt,
        step=post.step,
        epoch=post.epoch,
        path=post.path,
        kind=post.kind,
        metrics=metrics,
    )
    session.add(checkpoint)
    if post.kind in ("hf", "adapter"):
        # A LoRA run exporting both posts its adapter first: the full model, posted last,
        # is the run's model_path.
        run.model_path = post.path
        what = "LoRA adapter" if post.kind == "adapter" else "model"
        record_event(session, run, type=EventType.EXPORT, message=f"{what} exported to {post.path}")
    else:
        run.latest_checkpoint = post.path
        record_event(
            session, run, type=EventType.CHECKPOINT, message=f"checkpoint at step {post.step}"
        )
    session.flush()
    run_result.record_checkpoint(run, checkpoint)  # after the flush: it names the row's id
    view = CheckpointView.of(checkpoint).model_dump(mode="json")
    enqueue_webhooks(session, run, "run.checkpoint", {"checkpoint": view}, hooks=hooks)
    return checkpoint
