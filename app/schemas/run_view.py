"""What clients read: runs, metrics, checkpoints — shaped from the stored rows."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

from fastapi import Response
from pydantic import BaseModel, Field

from app.schemas.profile import ProfileView
from app.storage.models import Checkpoint, Event, Metric
from contract.callbacks import StartupPhase

# A metric that is not a finite number (a diverging run's loss): JSON and SQLite's REAL
# hold no NaN or infinity, so it is stored and served as null plus this flag.
NonFinite = Literal["nan", "inf", "-inf"]
_KINDS: dict[str, NonFinite] = {"nan": "nan", "inf": "inf", "-inf": "-inf"}

_NONFINITE_DOC = (
    "Metrics whose value is not a finite number (a diverging run), by name: "
    '"nan", "inf" or "-inf". Their value in `{field}` is null: JSON has no NaN or Infinity.'
)


def nonfinite_kind(value: float) -> NonFinite | None:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return None


def stored_metric_value(value: float) -> float | str:
    """How a metric goes into a JSON column (`runs.latest_metrics`, `checkpoints.metrics`):
    a non-finite one as its kind's name, since JSON cannot hold it (PostgreSQL refuses the
    NaN token outright). `split_metric_map` reads it back."""
    return nonfinite_kind(value) or value


def split_metric_map(
    stored: Mapping[str, object],
) -> tuple[dict[str, float | None], dict[str, NonFinite]]:
    """A stored metric map as it is served: values (null where not finite) and flags."""
    values: dict[str, float | None] = {}
    flags: dict[str, NonFinite] = {}
    for name, value in stored.items():
        kind = _KINDS.get(value) if isinstance(value, str) else None
        if isinstance(value, int | float):
            # A float NaN too: SQLite JSON written before non-finite values were encoded.
            kind = nonfinite_kind(float(value))
        if kind is not None:
            values[name], flags[name] = None, kind
        else:
            values[name] = float(value) if isinstance(value, int | float) else None
    return values, flags


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
    def latest_metrics(self) -> Mapping[str, object]: ...
    @property
    def error_code(self) -> str | None: ...
    @property
    def error_message(self) -> str | None: ...
    @property
    def model_path(self) -> str | None: ...
    @property
    def latest_checkpoint(self) -> str | None: ...
    @property
    def result(self) -> dict[str, Any] | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def preemptible(self) -> bool: ...
    @property
    def queue_reason(self) -> str | None: ...


class ProgressView(BaseModel):
    step: int
    total_steps: int | None
    epoch: float | None
    fraction: float | None
    eta_seconds: float | None = Field(
        description="While running: the steps left times the latest measured step time "
        "(`latest_metrics.step_time_seconds`); null otherwise."
    )
    estimated_finish: datetime | None = Field(
        default=None,
        description="While running: when the steps will be done at the measured pace, the "
        "time of this answer plus `eta_seconds` (evaluations, checkpoints and the export "
        "not counted); null otherwise.",
    )


class ErrorView(BaseModel):
    code: str
    message: str


class OutputView(BaseModel):
    model_path: str | None
    latest_checkpoint: str | None


class ResultView(BaseModel):
    """Why the run stopped and its best checkpoint, as far as it has got."""

    stop_reason: Literal["completed", "early_stopping"] | None = Field(
        default=None,
        description="completed: it trained every step; early_stopping: evaluation stopped "
        "improving (early_stopping in the request). Null while it runs, or if it failed.",
    )
    stop_message: str | None = None
    best_metric: str | None = Field(
        default=None, description="The metric that ranks its checkpoints, if any."
    )
    best_mode: Literal["min", "max"] | None = None
    best_step: int | None = Field(default=None, description="The step of the best checkpoint.")
    best_value: float | None = Field(default=None, description="Its value of best_metric.")

    @classmethod
    def of(cls, stored: dict[str, Any] | None) -> ResultView:
        stored = stored or {}
        return cls(**{k: v for k, v in stored.items() if k in cls.model_fields})


class QueueView(BaseModel):
    """Where a queued run stands (app/services/scheduling.py has the rules)."""

    position: int | None = Field(
        description="1: the next run the scheduler takes when the cluster has room. The "
        "order is priority, then fair share between API keys, then age."
    )
    reason: str | None = Field(
        description="Why it waits, as the scheduler's latest pass found: e.g. `waiting for "
        "cluster resources (needs 4 GPUs, 2 free)`, `waiting for quota (2 of 2 running, "
        "max_running_runs)`, `behind higher priority (...)`, and for a preempted run until "
        "it starts again `preempted (resumes from step N): ` and why it waits now. Null "
        "before its first pass."
    )


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
    latest_metrics: dict[str, float | None] = Field(
        description="The metrics of the latest step reported, by name; null for a value "
        "that is not a finite number, which `nonfinite_metrics` names."
    )
    nonfinite_metrics: dict[str, NonFinite] = Field(
        default_factory=dict, description=_NONFINITE_DOC.format(field="latest_metrics")
    )
    error: ErrorView | None
    output: OutputView
    result: ResultView = Field(default_factory=ResultView)
    metadata: dict[str, str]
    # Only while queued: 1 means it is dispatched next (as `queue.position`).
    queue_position: int | None = None
    queue: QueueView | None = Field(
        default=None, description="Only while queued: its place and why it waits."
    )

    @classmethod
    def of(cls, run: RunFields, *, queue_position: int | None = None) -> RunView:
        fraction = run.step / run.total_steps if run.total_steps else None
        latest, nonfinite = split_metric_map(run.latest_metrics)
        step_time = latest.get("step_time_seconds")
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
            spec={
                **run.spec,
                "metadata": run.run_metadata,
                "priority": run.priority,
                "preemptible": run.preemptible,
            },
            progress=ProgressView(
                step=run.step,
                total_steps=run.total_steps,
                epoch=run.epoch,
                fraction=fraction,
                eta_seconds=eta,
                estimated_finish=datetime.now(UTC) + timedelta(seconds=eta)
                if eta is not None
                else None,
            ),
            latest_metrics=latest,
            nonfinite_metrics=nonfinite,
            error=ErrorView(code=run.error_code, message=run.error_message or "")
            if run.error_code
            else None,
            output=OutputView(model_path=run.model_path, latest_checkpoint=run.latest_checkpoint),
            result=ResultView.of(run.result),
            metadata=run.run_metadata,
            queue_position=queue_position,
            queue=QueueView(position=queue_position, reason=run.queue_reason)
            if run.status == "queued"
            else None,
        )


class RunList(BaseModel):
    object: str = "list"
    data: list[RunView]
    next_cursor: str | None


class MetricView(BaseModel):
    step: int
    name: str
    value: float | None = Field(
        description="The value; null when it is not a finite number, and `nonfinite` says "
        "which (JSON has no NaN or Infinity)."
    )
    nonfinite: NonFinite | None = Field(
        default=None,
        description='"nan", "inf" or "-inf" when the value is not a finite number '
        "(a diverging run); null otherwise.",
    )
    time: datetime
    attempt: int

    @classmethod
    def of(cls, m: Metric) -> MetricView:
        value, nonfinite = m.value, _KINDS.get(m.nonfinite or "")
        if value is not None and (kind := nonfinite_kind(value)) is not None:
            # PostgreSQL's double precision holds NaN and infinity: rows stored before
            # they were kept as null plus a flag may carry one.
            value, nonfinite = None, kind
        return cls(
            step=m.step,
            name=m.name,
            value=value,
            nonfinite=nonfinite,
            time=as_utc(m.time),
            attempt=m.attempt,
        )


class MetricList(BaseModel):
    object: str = "list"
    data: list[MetricView]
    next_cursor: str | None


class CheckpointView(BaseModel):
    step: int
    epoch: float | None
    path: str
    kind: str
    metrics: dict[str, float | None] = Field(
        description="The metrics reported with the checkpoint; null for a value that is "
        "not a finite number, which `nonfinite_metrics` names."
    )
    nonfinite_metrics: dict[str, NonFinite] = Field(
        default_factory=dict, description=_NONFINITE_DOC.format(field="metrics")
    )
    attempt: int
    created_at: datetime
    pruned: bool = Field(
        default=False,
        description="Deleted from storage by `checkpointing.keep_last`: Ray Train keeps the "
        "newest `keep_last` DeepSpeed checkpoints of a run, across its attempts (with a best "
        "metric, the `keep_last` best by it), and always the latest.",
    )
    best: bool = Field(
        default=False,
        description="The run's best checkpoint by its best metric (checkpointing.best_metric, "
        "early_stopping.metric); kept whatever keep_last says.",
    )

    @classmethod
    def of(cls, c: Checkpoint, *, pruned: bool = False, best: bool = False) -> CheckpointView:
        metrics, nonfinite = split_metric_map(c.metrics)
        return cls(
            step=c.step,
            epoch=c.epoch,
            path=c.path,
            kind=c.kind,
            metrics=metrics,
            nonfinite_metrics=nonfinite,
            attempt=c.attempt,
            created_at=as_utc(c.created_at),
            pruned=pruned,
            best=best,
        )


class CheckpointList(BaseModel):
    object: str = "list"
    data: list[CheckpointView]


class ValidationReport(BaseModel):
    valid: bool
    errors: list[dict[str, str]]
    resolved: dict[str, Any] | None
    estimate: dict[str, Any] | None
    profile: ProfileView | None = Field(
        default=None,
        description="What a few real steps measured on the cluster: only for a valid request "
        "that asked for `profile: true`.",
    )


class EventView(BaseModel):
    id: int
    type: str
    status: str | None
    message: str
    attempt: int
    repeats: int = Field(
        default=1,
        description="How many times in a row this same event happened (a dispatch retried "
        "while Ray is unreachable, for example): repeats are kept as one event.",
    )
    phase: StartupPhase | None = Field(
        default=None,
        description="A `startup_phase` event's part of the attempt's start, in the order they "
        "happen: job (submit to the job's driver), driver (its imports and checks), workers "
        "(Ray Train placing and starting the ranks), process_group (a rank's torch, CUDA and "
        "process group), imports (DeepSpeed), data, model, deepspeed (optimizer and engine), "
        "first_step. Null for other events.",
    )
    duration_seconds: float | None = Field(
        default=None, description="How long the `startup_phase` took. Null for other events."
    )
    created_at: datetime

    @classmethod
    def of(cls, e: Event) -> EventView:
        return cls(
            id=e.id,
            type=e.type,
            status=e.status,
            message=e.message,
            attempt=e.attempt,
            repeats=e.repeats or 1,
            phase=StartupPhase(e.phase) if e.phase else None,
            duration_seconds=e.duration_seconds,
            created_at=as_utc(e.created_at),
        )


class EventList(BaseModel):
    object: str = "list"
    data: list[EventView]
