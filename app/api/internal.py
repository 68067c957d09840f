"""/v1/internal/runs/{id}/…: where the worker posts status, metrics and checkpoints."""

from __future__ import annotations

from fastapi import APIRouter, Request, Security

from app.api.deps import MetricsDep, SessionDep, bearer_token
from app.schemas.callbacks import CheckpointPost, EventPost, MetricsPost, StatusPost
from app.schemas.errors import error_responses
from app.schemas.security_schemes import run_token
from app.services import callbacks
from app.services.lifecycle import record_event

router = APIRouter(
    prefix="/v1/internal/runs", tags=["worker callbacks"], dependencies=[Security(run_token)]
)

_errors = error_responses(
    {
        400: "The body is not UTF-8 text",
        401: "Missing, wrong or expired run token",
        404: "No such run",
        409: "The attempt is over, or the status change is not allowed",
        422: "The body breaks the callback schema; `detail` names each field and rule",
    }
)


@router.post("/{run_id}/status", summary="Worker: report a status change", responses=_errors)
def post_status(
    run_id: str, body: StatusPost, request: Request, session: SessionDep, metrics: MetricsDep
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    callbacks.apply_status(session, run, body)
    metrics.callbacks.labels("status").inc()
    return {"status": run.status}


@router.post("/{run_id}/metrics", summary="Worker: post a batch of metrics", responses=_errors)
def post_metrics(
    run_id: str, body: MetricsPost, request: Request, session: SessionDep, metrics: MetricsDep
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    stored = callbacks.store_metrics(session, run, body)
    metrics.callbacks.labels("metrics").inc()
    metrics.metric_points.inc(stored)
    return {"stored": stored}


@router.post("/{run_id}/checkpoints", summary="Worker: record a checkpoint", responses=_errors)
def post_checkpoint(
    run_id: str, body: CheckpointPost, request: Request, session: SessionDep, metrics: MetricsDep
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    checkpoint = callbacks.store_checkpoint(session, run, body)
    metrics.callbacks.labels("checkpoint").inc()
    return {"id": checkpoint.id}


@router.post(
    "/{run_id}/events", summary="Worker: record something that happened", responses=_errors
)
def post_event(
    run_id: str, body: EventPost, request: Request, session: SessionDep, metrics: MetricsDep
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    event = record_event(session, run, type=body.type, message=body.message)
    session.flush()
    metrics.callbacks.labels("event").inc()
    return {"id": event.id}
