"""Bodies the worker posts to /v1/internal/runs/{id}/…, authenticated by the run token.

Every number that reaches an INTEGER column is bounded by what PostgreSQL holds, and every
name that reaches a query refuses NUL: either would otherwise fail in the database (a 500)
instead of answering a 422 that names the field.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from contract.bounds import INT32_MAX, refuse_nul

_strict = ConfigDict(extra="forbid", allow_inf_nan=True)

Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Attempt = Annotated[int, Field(ge=0, le=INT32_MAX)]
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
# Strict JSON has no literal for them: the worker sends them as strings (worker/
# service_client.py, json_safe), and a bare NaN token is read too.
MetricValue = Annotated[
    float,
    Field(
        description='A number, or "NaN", "Infinity" or "-Infinity" for one that is not '
        "finite. Stored and served as `null` with `nonfinite` set to "
        '"nan", "inf" or "-inf" (JSON and SQLite cannot hold them).'
    ),
]


class ErrorBody(BaseModel):
    model_config = _strict
    code: Annotated[str, Field(max_length=32), AfterValidator(refuse_nul)]
    message: Message


class StatusPost(BaseModel):
    model_config = _strict
    attempt: Attempt
    status: Literal["running", "succeeded", "failed"]
    message: Message | None = None
    error: ErrorBody | None = None


class MetricPoint(BaseModel):
    model_config = _strict
    step: Count
    name: MetricName
    value: MetricValue
    time: datetime


class Progress(BaseModel):
    model_config = _strict
    step: Count
    total_steps: Count | None = None
    epoch: Epoch = None


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
    # hf: a full model export; adapter: a LoRA adapter export (peft).
    kind: Literal["deepspeed", "hf", "adapter"]
    metrics: dict[MetricName, MetricValue] = Field(default_factory=dict)


class EventPost(BaseModel):
    model_config = _strict
    attempt: Attempt
    type: str = Field(min_length=1, max_length=32, pattern=r"^[a-z_]+$")
    message: Message
