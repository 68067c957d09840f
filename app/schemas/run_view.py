"""What clients read: runs, metrics, checkpoints — shaped from the stored rows."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi import Response
from pydantic import BaseModel

from app.models import Checkpoint, Event, Metric


def as_utc(value: datetime | None) -> datetime | None:
    # SQLite returns naive datetimes; everything tuneyard stores is UTC.
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def json_response(view: BaseModel, *, status_code: int = 200) -> Response:
    """`view` as JSON, serialized once by pydantic. Returned from a route, it skips FastAPI's
    response_model handling, which validates the view again (in a worker thread, for a sync
    route) before serializing it. The route keeps `response_model=` for its OpenAPI schema."""
    return Response(view.model_dump_json(), status_code=status_code, media_type="application/json")


# Fields a client may be tempted to send back from a run object; the server owns them.
SERVER_OWNED_FIELDS = frozenset(
    {
        "id",
        "object",
        "status",
        "attempt",
        "owner",
        "owner_id",
        "ray_submission_id",
        "created_at",
        "started_at",
        "finished_at",
        "progress",
        "latest_metrics",
        "error",
        "output",
    }
)


class RunFields(Protocol):
    """What a run's view is made of: a `Run`, or a row of its columns (`runs.read_run`)."""

    @property
    def id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def ray_submission_id(self) -> str | None: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def queued_at(self) -> datetime: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def finished_at(self) -> datetime | None: ...
    @property
    def spec(self) -> dict[str, Any]: ...
    @property
    def run_metadata(self) -> dict[str, str]: ...
    @property
    def step(self) -> int: ...
    @property
    def total_steps(self) -> int | None: ...
    @property
    def epoch(self) -> float | None: ...
    @property
    def latest_metrics(self) -> dict[str, float]: ...
    @property
    def error_code(self) -> str | None: ...
    @property
    def error_message(self) -> str | None: ...
    @property
    def model_path(self) -> str | None: ...
    @property
    def latest_checkpoint(self) -> str | None: ...


class ProgressView(BaseModel):
    step: int
    total_steps: int | None
    epoch: float | None
    fraction: float | None
    eta_seconds: float | None


class ErrorView(BaseModel):
    code: str
    message: str


class OutputView(BaseModel):
    model_path: str | None
    latest_checkpoint: str | None


class RunView(BaseModel):
    object: str = "run"
    id: str
    status: str
    attempt: int
    ray_submission_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any]
    progress: ProgressView
    latest_metrics: dict[str, float]
    error: ErrorView | None
    output: OutputView
    metadata: dict[str, str]
    # Only while queued: 1 means it is dispatched next.
    queue_position: int | None = None

    @classmethod
    def of(cls, run: RunFields, *, queue_position: int | None = None) -> RunView:
        fraction = run.step / run.total_steps if run.total_steps else None
        step_time = run.latest_metrics.get("step_time_seconds")
        eta = (
            (run.total_steps - run.step) * step_time
            if run.total_steps and step_time is not None and run.status == "running"
            else None
        )
        return cls(
            id=run.id,
            status=run.status,
            attempt=run.attempt,
            ray_submission_id=run.ray_submission_id,
            created_at=as_utc(run.created_at),
            started_at=as_utc(run.started_at),
            finished_at=as_utc(run.finished_at),
            spec={**run.spec, "metadata": run.run_metadata},
            progress=ProgressView(
                step=run.step,
                total_steps=run.total_steps,
                epoch=run.epoch,
                fraction=fraction,
                eta_seconds=eta,
            ),
            latest_metrics=run.latest_metrics,
            error=ErrorView(code=run.error_code, message=run.error_message or "")
            if run.error_code
            else None,
            output=OutputView(model_path=run.model_path, latest_checkpoint=run.latest_checkpoint),
            metadata=run.run_metadata,
            queue_position=queue_position,
        )


class RunList(BaseModel):
    object: str = "list"
    data: list[RunView]
    next_cursor: str | None


class MetricView(BaseModel):
    step: int
    name: str
    value: float
    time: datetime
    attempt: int

    @classmethod
    def of(cls, m: Metric) -> MetricView:
        return cls(step=m.step, name=m.name, value=m.value, time=as_utc(m.time), attempt=m.attempt)


class MetricList(BaseModel):
    object: str = "list"
    data: list[MetricView]
    next_cursor: str | None


class CheckpointView(BaseModel):
    step: int
    epoch: float | None
    path: str
    kind: str
    metrics: dict[str, float]
    attempt: int
    created_at: datetime

    @classmethod
    def of(cls, c: Checkpoint) -> CheckpointView:
        return cls(
            step=c.step,
            epoch=c.epoch,
            path=c.path,
            kind=c.kind,
            metrics=c.metrics,
            attempt=c.attempt,
            created_at=as_utc(c.created_at),
        )


class CheckpointList(BaseModel):
    object: str = "list"
    data: list[CheckpointView]


class ValidationReport(BaseModel):
    valid: bool
    errors: list[dict[str, str]]
    resolved: dict[str, Any] | None
    estimate: dict[str, Any] | None


class EventView(BaseModel):
    id: int
    type: str
    status: str | None
    message: str
    attempt: int
    created_at: datetime

    @classmethod
    def of(cls, e: Event) -> EventView:
        return cls(
            id=e.id,
            type=e.type,
            status=e.status,
            message=e.message,
            attempt=e.attempt,
            created_at=as_utc(e.created_at),
        )


class EventList(BaseModel):
    object: str = "list"
    data: list[EventView]
