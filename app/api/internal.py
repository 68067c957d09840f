"""/v1/internal/runs/{id}/…: where the worker posts status, metrics and checkpoints."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.deps import SessionDep, bearer_token
from app.schemas.callbacks import CheckpointPost, EventPost, MetricsPost, StatusPost
from app.services import callbacks
from app.services.run_status import record_event

router = APIRouter(prefix="/v1/internal/runs", tags=["worker callbacks"])

_errors: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing, wrong or expired run token"},
    404: {"description": "No such run"},
    409: {"description": "The attempt is over, or the status change is not allowed"},
}


@router.post("/{run_id}/status", summary="Worker: report a status change", responses=_errors)
def post_status(run_id: str, body: StatusPost, request: Request, session: SessionDep) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    callbacks.apply_status(session, run, body)
    return {"status": run.status}


@router.post("/{run_id}/metrics", summary="Worker: post a batch of metrics", responses=_errors)
def post_metrics(run_id: str, body: MetricsPost, request: Request, session: SessionDep) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    return {"stored": callbacks.store_metrics(session, run, body)}


@router.post("/{run_id}/checkpoints", summary="Worker: record a checkpoint", responses=_errors)
def post_checkpoint(
    run_id: str, body: CheckpointPost, request: Request, session: SessionDep
) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    checkpoint = callbacks.store_checkpoint(session, run, body)
    return {"id": checkpoint.id}


@router.post(
    "/{run_id}/events", summary="Worker: record something that happened", responses=_errors
)
def post_event(run_id: str, body: EventPost, request: Request, session: SessionDep) -> dict:
    run = callbacks.authorize_worker(
        session, run_id=run_id, token=bearer_token(request), attempt=body.attempt
    )
    event = record_event(session, run, type=body.type, message=body.message)
    session.flush()
    return {"id": event.id}
