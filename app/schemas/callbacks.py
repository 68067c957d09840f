"""Bodies the worker posts to /v1/internal/runs/{id}/…, authenticated by the run token."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_strict = ConfigDict(extra="forbid", allow_inf_nan=True)


class ErrorBody(BaseModel):
    model_config = _strict
    code: str = Field(max_length=32)
    message: str = Field(max_length=10_000)


class StatusPost(BaseModel):
    model_config = _strict
    attempt: int
    status: Literal["running", "succeeded", "failed"]
    message: str | None = Field(default=None, max_length=10_000)
    error: ErrorBody | None = None


class MetricPoint(BaseModel):
    model_config = _strict
    step: int = Field(ge=0)
    name: str = Field(min_length=1, max_length=64)
    # NaN/inf losses are real training outcomes worth seeing, so they are accepted.
    value: float
    time: datetime


class Progress(BaseModel):
    model_config = _strict
    step: int = Field(ge=0)
    total_steps: int | None = Field(default=None, ge=0)
    epoch: float | None = None


class MetricsPost(BaseModel):
    model_config = _strict
    attempt: int
    points: list[MetricPoint] = Field(max_length=10_000)
    progress: Progress | None = None


class CheckpointPost(BaseModel):
    model_config = _strict
    attempt: int
    step: int = Field(ge=0)
    epoch: float | None = None
    path: str = Field(min_length=1, max_length=4096)
    kind: Literal["deepspeed", "hf"]
    metrics: dict[str, float] = Field(default_factory=dict)


class EventPost(BaseModel):
    model_config = _strict
    attempt: int
    type: str = Field(min_length=1, max_length=32, pattern=r"^[a-z_]+$")
    message: str = Field(max_length=10_000)
