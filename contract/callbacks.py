"""Bodies the worker posts to /v1/internal/runs/{id}/…, authenticated by the run token:
the worker builds them (worker/reporting/service_client.py) and the service validates them
(app/api/internal.py), so a field, a failure code or an event type is spelled once.

Every number that reaches an INTEGER column is bounded by what PostgreSQL holds, and every
name that reaches a query refuses NUL: either would otherwise fail in the database (a 500)
instead of answering a 422 that names the field.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from contract.bounds import INT32_MAX, refuse_nul


class FailureCode(StrEnum):
    """Why a run failed: a run's `error.code`. What the service does next depends on it (a
    cluster error is retried from the latest checkpoint, a training error is not), so a
    misspelt code must fail where it is written, not turn a retry into a failure."""

    # Said by the worker (worker/reporting/failures.py).
    TRAINING_ERROR = "training_error"  # the run's own model, data, code or memory
    CLUSTER_ERROR = "cluster_error"  # Ray failed under the run (a node or the head went away)
    UNPLACEABLE = "unplaceable"  # no node of the cluster could ever hold a worker
    # Said by the service (app/services/lifecycle.py, app/services/dispatch.py).
    LOST = "lost"  # attempts were lost to the cluster until none remained
    RAY_REJECTED = "ray_rejected"  # Ray refused the job
    JOB_FAILED = "job_failed"  # Ray's job failed without the worker saying why
    STOPPED = "stopped"  # the Ray job was stopped from outside tuneyard


WORKER_FAILURES = frozenset(
    {FailureCode.TRAINING_ERROR, FailureCode.CLUSTER_ERROR, FailureCode.UNPLACEABLE}
)


class EventType(StrEnum):
    """A run's event types (`GET /v1/runs/{id}/events`, each event's `type`)."""

    # Written by the service.
    STATUS = "status"  # a status change
    MESSAGE = "message"  # a note on the run's way (a resubmit, a worker stopping)
    CHECKPOINT = "checkpoint"
    EXPORT = "export"
    # Posted by the worker; `preempted` by the service too, once the run is back in the queue.
    WORKER_STARTED = "worker_started"
    ENGINE_READY = "engine_ready"
    DATA_FITTED = "data_fitted"  # what the data made of the sequence length, and truncation
    RESUMED = "resumed"  # rank 0: the attempt restored the checkpoint at a step
    EARLY_STOPPED = "early_stopped"
    EXPORT_FROM_BEST = "export_from_best"
    TRACKING_FAILED = "tracking_failed"  # an experiment tracker stopped taking metrics
    PREEMPTED = "preempted"  # the attempt saved a checkpoint and stopped for the scheduler
    WAITING_FOR_RESOURCES = "waiting_for_resources"  # placement waits for the cluster to grow
    WORKERS_PLACED = "workers_placed"  # which node holds which rank
    STARTUP_PHASE = "startup_phase"  # one part of an attempt's start, with its duration


class StartupPhase(StrEnum):
    """The parts of an attempt's start, in the order they happen: each is reported as a
    `startup_phase` event with its `duration_seconds` (worker/reporting/startup.py says
    where each is measured), so a slow start says where its time went."""

    JOB = "job"  # the service's submit to the job's driver process starting (Ray's job start)
    DRIVER = "driver"  # the driver's imports and checks, up to Ray Train's fit()
    WORKERS = "workers"  # fit() to rank 0's process starting: placement, worker actors
    PROCESS_GROUP = "process_group"  # rank 0's process to its training function: torch, CUDA,
    # and the process group Ray Train starts
    IMPORTS = "imports"  # the rank's device and threads, and DeepSpeed's import
    DATA = "data"  # tokenizer, dataset loading, tokenizing and packing
    MODEL = "model"  # the model's weights loaded (partitioned under ZeRO-3)
    DEEPSPEED = "deepspeed"  # optimizer, schedule and deepspeed.initialize
    FIRST_STEP = "first_step"  # the attempt's first optimizer step, warm-up and all


WORKER_EVENTS = frozenset(
    {
        EventType.MESSAGE,
        EventType.WORKER_STARTED,
        EventType.ENGINE_READY,
        EventType.DATA_FITTED,
        EventType.RESUMED,
        EventType.EARLY_STOPPED,
        EventType.EXPORT_FROM_BEST,
        EventType.TRACKING_FAILED,
        EventType.PREEMPTED,
        EventType.WAITING_FOR_RESOURCES,
        EventType.WORKERS_PLACED,
        EventType.STARTUP_PHASE,
    }
)


def _the_workers(allowed: frozenset[StrEnum]) -> AfterValidator:
    """Of the values both sides know, only those a worker may send."""

    def check(value: StrEnum) -> StrEnum:
        if value not in allowed:
            raise ValueError(f"a worker sends one of {sorted(allowed)}, not {value!r}")
        return value

    return AfterValidator(check)


# Non-finite values go out as "NaN", "Infinity" and "-Infinity" (strict JSON has no literal
# for them) and come back in as floats.
_strict = ConfigDict(extra="forbid", allow_inf_nan=True, ser_json_inf_nan="strings")

Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Strict: JSON's `true` is not attempt 1.
Attempt = Annotated[int, Field(ge=0, le=INT32_MAX, strict=True)]
# Finite: an epoch is counted, never diverges, and it is stored as is (SQLite would turn a
# NaN into NULL, PostgreSQL keep it and JSON fail to serve it).
Epoch = Annotated[float | None, Field(allow_inf_nan=False)]


def _replace_nul(value: str | None) -> str | None:
    # Free text (an error message quoting a binary file) may carry NUL; PostgreSQL text
    # cannot. Refusing it would lose the worker's failure message, so it is replaced.
    return value.replace("\x00", "\ufffd") if value is not None else None


Message = Annotated[str, Field(max_length=10_000), AfterValidator(_replace_nul)]
MetricName = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(refuse_nul)]

# A diverging run's loss is a real outcome worth seeing, so non-finite values are taken.
# Strict JSON has no literal for them: the worker sends them as strings (`ser_json_inf_nan`
# below), and a bare NaN token is read too.
MetricValue = Annotated[
    float,
    Field(
        description='A number, or "NaN", "Infinity" or "-Infinity" for one that is not '
        "finite. Stored and served as `null` with `nonfinite` set to "
        '"nan", "inf" or "-inf" (JSON and SQLite cannot hold them).'
    ),
]


# deepspeed: a training checkpoint; hf: a full model export; adapter: a LoRA adapter export
# (peft).
CheckpointKind = Literal["deepspeed", "hf", "adapter"]


# What a worker may say of its attempt; the rest of a run's statuses are the service's.
WorkerStatus = Literal["running", "succeeded", "failed"]


class ErrorBody(BaseModel):
    model_config = _strict
    code: Annotated[FailureCode, _the_workers(WORKER_FAILURES)]
    message: Message


class StatusPost(BaseModel):
    model_config = _strict
    attempt: Attempt
    status: WorkerStatus
    message: Message | None = None
    error: ErrorBody | None = None

    @model_validator(mode="after")
    def _error_with_failure_only(self) -> StatusPost:
        # A succeeded run with an error, or a failed one without: what a user reads of the
        # run would contradict itself, and a failure without a code cannot be retried right.
        if self.status == "failed" and self.error is None:
            raise ValueError("a failed status carries its error (code and message)")
        if self.status != "failed" and self.error is not None:
            raise ValueError(f"only a failed status carries an error, not {self.status!r}")
        return self


def _in_utc(value: datetime) -> datetime:
    """A time as UTC (one without an offset is taken as UTC): SQLite keeps a time without
    its offset, so another offset would be served as a different time; and a time that UTC
    puts past year 9999 (or before year 1) is stored by PostgreSQL but cannot be read back
    into Python, which failed every later read of the run's metrics."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        value = value.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError("the time is out of range once in UTC") from exc
    # 9998: a database session in a time zone east of UTC reads the last day of 9999 as
    # year 10000, which Python has no date for.
    if not 1970 <= value.year <= 9998:
        raise ValueError("the time must fall between the years 1970 and 9998 in UTC")
    return value


class MetricPoint(BaseModel):
    model_config = _strict
    step: Count
    name: MetricName
    value: MetricValue
    time: Annotated[datetime, AfterValidator(_in_utc)]


class Progress(BaseModel):
    model_config = _strict
    step: Count
    total_steps: Count | None = None
    epoch: Epoch = None

    @model_validator(mode="after")
    def _within_the_run(self) -> Progress:
        # A step past the end would read as a run trained out (and a fraction above 1).
        if self.total_steps is not None and self.step > self.total_steps:
            raise ValueError(
                f"progress.step ({self.step}) is past progress.total_steps ({self.total_steps})"
            )
        return self


class MetricsPost(BaseModel):
    model_config = _strict
    attempt: Attempt
    points: list[MetricPoint] = Field(max_length=10_000)
    progress: Progress | None = None


class CheckpointPost(BaseModel):
    model_config = _strict
    attempt: Attempt
    step: Count
    epoch: Epoch = None
    path: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(refuse_nul)]
    kind: CheckpointKind
    metrics: dict[MetricName, MetricValue] = Field(default_factory=dict)


class EventPost(BaseModel):
    model_config = _strict
    attempt: Attempt
    type: Annotated[EventType, _the_workers(WORKER_EVENTS)]
    message: Message
    # A startup_phase event's, and only its.
    phase: StartupPhase | None = None
    duration_seconds: Annotated[float, Field(ge=0, le=INT32_MAX, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _phase_with_its_type(self) -> EventPost:
        timed = self.phase is not None and self.duration_seconds is not None
        if self.type == EventType.STARTUP_PHASE and not timed:
            raise ValueError("a startup_phase event names its phase and its duration_seconds")
        if self.type != EventType.STARTUP_PHASE and (
            self.phase is not None or self.duration_seconds is not None
        ):
            raise ValueError("only a startup_phase event has a phase and duration_seconds")
        return self
