"""/v1/internal/runs/{id}/…: where the worker posts status, metrics and checkpoints."""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Security
from sqlalchemy.orm import Session

from app.api.deps import MetricsDep, SessionDep, bearer_token, run_in_read_session
from app.schemas.callbacks import CheckpointPost, EventPost, MetricsPost, StatusPost
from app.schemas.errors import error_responses
from app.schemas.security_schemes import run_token
from app.services import callbacks, lifecycle, run_result
from app.services.lifecycle import record_event
from app.services.webhooks import enqueue_webhooks
from contract.bounds import INT32_MAX


async def verified_token(run_id: str, request: Request) -> str:
    """The hash of the run's token, once the request's token matched it. A dependency that
    every route declares before `SessionDep`: a wrong token is refused after one read, and
    never takes a write session (on SQLite, the one write lock that every writer queues for).
    """
    stored = await run_in_read_session(
        request, functools.partial(callbacks.read_token_hash, run_id=run_id)
    )
    return callbacks.verify_token(bearer_token(request), stored)


# Declared before SessionDep in each route: FastAPI solves dependencies in that order.
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
        422: "The body breaks the callback schema; `detail` names each field and rule",
    }
)


@router.post("/{run_id}/status", summary="Worker: report a status change", responses=_errors)
def post_status(
    run_id: str,
    body: StatusPost,
    token_hash: VerifiedToken,
    session: SessionDep,
    metrics: MetricsDep,
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
    )
    callbacks.apply_status(session, run, body)
    metrics.callbacks.labels("status").inc()
    return {"status": run.status}


@router.post("/{run_id}/metrics", summary="Worker: post a batch of metrics", responses=_errors)
def post_metrics(
    run_id: str,
    body: MetricsPost,
    token_hash: VerifiedToken,
    session: SessionDep,
    metrics: MetricsDep,
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
    )
    stored = callbacks.store_metrics(session, run, body)
    metrics.callbacks.labels("metrics").inc()
    metrics.metric_points.inc(stored)
    return {"stored": stored}


@router.post("/{run_id}/checkpoints", summary="Worker: record a checkpoint", responses=_errors)
def post_checkpoint(
    run_id: str,
    body: CheckpointPost,
    token_hash: VerifiedToken,
    session: SessionDep,
    metrics: MetricsDep,
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
    )
    checkpoint = callbacks.store_checkpoint(session, run, body)
    metrics.callbacks.labels("checkpoint").inc()
    return {"id": checkpoint.id}


@router.post(
    "/{run_id}/events", summary="Worker: record something that happened", responses=_errors
)
def post_event(
    run_id: str,
    body: EventPost,
    token_hash: VerifiedToken,
    session: SessionDep,
    metrics: MetricsDep,
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token_hash=token_hash, attempt=body.attempt
    )
    if body.type == "preempted" and lifecycle.preempting(run):
        # The worker saved its checkpoint and is stopping: the run goes back to the queue.
        lifecycle.requeue_preempted(session, run, how=f"the worker said: {body.message}")
        session.flush()
        metrics.callbacks.labels("event").inc()
        return {"id": None}
    # A `preempted` left here stopped for a preemption the run no longer waits on (it was
    # cancelled meanwhile): a note, not a `preempted` event; the cancel settles the run.
    kind = "message" if body.type == "preempted" else body.type
    event = record_event(session, run, type=kind, message=body.message)
    if body.type == "early_stopped":
        run_result.record_early_stop(run, body.message)
    # Once per early stop: a worker repeating its post is counted on the same event row.
    if body.type == "early_stopped" and event.repeats == 1:
        enqueue_webhooks(session, run, "run.early_stopped", {"message": event.message})
    session.flush()
    metrics.callbacks.labels("event").inc()
    return {"id": event.id}


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
