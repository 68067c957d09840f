"""/v1/internal/runs/{id}/…: where the worker posts status, metrics and checkpoints."""

from __future__ import annotations

import functools
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Query, Request, Security
from sqlalchemy.orm import Session

from app.api.deps import (
    MetricsDep,
    SettingsDep,
    app_state,
    bearer_token,
    run_in_read_session,
    run_in_write_session,
)
from app.schemas.errors import error_responses
from app.schemas.security_schemes import run_token
from app.services import callbacks, lifecycle, run_result
from app.services.lifecycle import record_event
from app.services.webhooks import enqueue_webhooks
from contract.bounds import INT32_MAX
from contract.callbacks import CheckpointPost, EventPost, EventType, MetricsPost, StatusPost


async def verified_token(run_id: str, request: Request) -> str:
    """The hash of the run's token, once the request's token matched it. A dependency of
    every route, solved before the route writes: a wrong token is refused after one read,
    and never takes a write session (on SQLite, the one write lock every writer queues for).
    """
    stored = await run_in_read_session(
        request, functools.partial(callbacks.read_token_hash, run_id=run_id)
    )
    return callbacks.verify_token(bearer_token(request), stored)


VerifiedToken = Annotated[str, Depends(verified_token)]

# Served, but not in the public OpenAPI document: only tuneyard's own worker calls these
# (app/services/callbacks.py checks its per-run token), and a client generated from the
# document should not grow methods that no client may use.
router = APIRouter(
    prefix="/v1/internal/runs",
    tags=["worker callbacks"],
    dependencies=[Security(run_token)],
    include_in_schema=False,
)

_errors = error_responses(
    {
        400: "The body is not UTF-8 text",
        401: "Missing, wrong or expired run token, or no such run (alike, on purpose)",
        409: "The attempt is over, or the status change is not allowed",
        422: "The body breaks the callback schema, or a checkpoint's path is not under "
        "storage/<run id>/; `detail` names each field and rule",
    }
)


# Each post is one write trip (`run_in_write_session`): the token was checked by a read
# before it, and nothing in it reads a file, so SQLite's write lock is held for the writes.


@router.post("/{run_id}/status", summary="Worker: report a status change", responses=_errors)
async def post_status(
    run_id: str, body: StatusPost, token_hash: VerifiedToken, request: Request, metrics: MetricsDep
) -> dict:
    def write(session: Session) -> dict:
        run = callbacks.authorize_worker(
            session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
        )
        callbacks.apply_status(session, run, body, hooks=app_state(request).hooks)
        return {"status": run.status}

    answer = await run_in_write_session(request, write)
    metrics.callbacks.labels("status").inc()
    return answer


@router.post("/{run_id}/metrics", summary="Worker: post a batch of metrics", responses=_errors)
async def post_metrics(
    run_id: str,
    body: MetricsPost,
    token_hash: VerifiedToken,
    request: Request,
    metrics: MetricsDep,
) -> dict:
    def write(session: Session) -> int:
        run = callbacks.authorize_worker(
            session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
        )
        return callbacks.store_metrics(session, run, body)

    stored = await run_in_write_session(request, write)
    metrics.callbacks.labels("metrics").inc()
    metrics.metric_points.inc(stored)
    return {"stored": stored}


@router.post("/{run_id}/checkpoints", summary="Worker: record a checkpoint", responses=_errors)
async def post_checkpoint(
    run_id: str,
    body: CheckpointPost,
    token_hash: VerifiedToken,
    request: Request,
    metrics: MetricsDep,
    settings: SettingsDep,
) -> dict:
    # Before the write: a local location's links are followed, which is file I/O.
    checked = await anyio.to_thread.run_sync(
        functools.partial(callbacks.checked_location, settings.storage, run_id=run_id, post=body)
    )

    def write(session: Session) -> dict:
        run = callbacks.authorize_worker(
            session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
        )
        stored = callbacks.store_checkpoint(session, run, checked, hooks=app_state(request).hooks)
        return {"id": stored.id}

    answer = await run_in_write_session(request, write)
    metrics.callbacks.labels("checkpoint").inc()
    return answer


@router.post(
    "/{run_id}/events", summary="Worker: record something that happened", responses=_errors
)
async def post_event(
    run_id: str, body: EventPost, token_hash: VerifiedToken, request: Request, metrics: MetricsDep
) -> dict:
    def write(session: Session) -> dict:
        run = callbacks.authorize_worker(
            session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
        )
        if body.type == EventType.PREEMPTED and lifecycle.preempting(run):
            # The worker saved its checkpoint and is stopping: the run goes back to the queue.
            lifecycle.requeue_preempted(session, run, how=f"the worker said: {body.message}")
            session.flush()
            return {"id": None}
        if body.type == EventType.STARTUP_PHASE and (
            first := callbacks.startup_phase_of(session, run, phase=body.phase)
        ):
            # A worker group Ray Train restarted within the attempt starts again: the
            # attempt's own start is the first (worker/reporting/startup.py).
            return {"id": first.id}
        # A `preempted` left here stopped for a preemption the run no longer waits on (it was
        # cancelled meanwhile): a note, not a `preempted` event; the cancel settles the run.
        kind = EventType.MESSAGE if body.type == EventType.PREEMPTED else body.type
        event = record_event(
            session,
            run,
            type=kind,
            message=body.message,
            phase=body.phase,
            duration_seconds=body.duration_seconds,
        )
        if body.type == EventType.EARLY_STOPPED:
            run_result.record_early_stop(run, body.message)
        # Once per early stop: a worker repeating its post is counted on the same event row.
        if body.type == EventType.EARLY_STOPPED and event.repeats == 1:
            enqueue_webhooks(
                session,
                run,
                "run.early_stopped",
                {"message": event.message},
                hooks=app_state(request).hooks,
            )
        session.flush()
        return {"id": event.id}

    answer = await run_in_write_session(request, write)
    metrics.callbacks.labels("event").inc()
    return answer


@router.get(
    "/{run_id}/control",
    summary="Worker: whether the scheduler asks this attempt to checkpoint and stop",
    responses=_errors,
)
async def get_control(
    run_id: str,
    attempt: Annotated[int, Query(ge=1, le=INT32_MAX)],
    token_hash: VerifiedToken,
    request: Request,
) -> dict:
    """Polled by the attempt's worker (every TUNEYARD_PREEMPTION_POLL_S): when preempted, it
    saves a checkpoint at the step it is on, stops, and posts the `preempted` event. A read
    session: every live run polls, and none of it may queue for SQLite's write lock."""

    def read(session: Session) -> dict:
        run = callbacks.authorize_worker(
            session, run_id=run_id, token_hash=token_hash, attempt=attempt, lock=False
        )
        if lifecycle.preempting(run):
            return {"preempt": True, "reason": run.preempt_reason or ""}
        return {"preempt": False}

    return await run_in_read_session(request, read)
