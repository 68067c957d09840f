"""SQLAlchemy models. The schema changes only through Alembic migrations in migrations/."""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy import (
    false as sa_false,
)
from sqlalchemy import (
    true as sa_true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from contract.run_request import RunDefinition
from contract.statuses import RunStatus

# Stable constraint names, so migrations can alter them on SQLite and PostgreSQL alike.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


# Ids are a prefix, "_" and this many random bytes in lower-case hex.
_ID_BYTES = 10


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(_ID_BYTES)}"


def minted_id(prefix: str) -> re.Pattern[str]:
    """The shape of every id `new_id(prefix)` makes, and so of every id of that kind there
    is. A client's id of any other shape (a NUL, which PostgreSQL refuses in text, a
    megabyte, another alphabet) names nothing: the lookups answer it as an unknown id
    without asking the database (`is_minted`)."""
    return re.compile(rf"{re.escape(prefix)}_[0-9a-f]{{{2 * _ID_BYTES}}}")


# A run's id as new_id makes it: a run may be named where a model is (train from its export).
RUN_ID = minted_id("run")
FILE_ID = minted_id("file")


def is_minted(kind: re.Pattern[str], value: str) -> bool:
    """Whether `value` has the shape of an id of this kind (`RUN_ID`, `FILE_ID`): the check
    every lookup of a client's id makes before its query."""
    return kind.fullmatch(value) is not None


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    # sha256 of the secret; the secret itself is shown once, at creation.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Set by `tuneyard keys revoke`; a revoked key authenticates nothing from then on.
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The key's share of the cluster (`tuneyard keys create/update`); None: no limit.
    # app/services/queue.py (check_submission) applies them, the scheduler
    # (app/services/scheduling.py) the running ones.
    max_running_runs: Mapped[int | None] = mapped_column(Integer)
    max_queued_runs: Mapped[int | None] = mapped_column(Integer)
    max_gpus: Mapped[int | None] = mapped_column(Integer)
    max_priority: Mapped[int | None] = mapped_column(Integer)
    # Signs this key's runs' webhook deliveries (app/services/webhooks.py), so that one
    # tenant cannot forge deliveries to another's receiver; shown once, when the key is made
    # or the secret rotated.
    webhook_secret: Mapped[str | None] = mapped_column(String(64))
    # May this key's runs set `preemptible: false`? None: unless `max_priority` caps the key
    # (a capped key could otherwise hold what no higher priority can take back); applied
    # by app/services/queue.py.
    allow_non_preemptible: Mapped[bool | None] = mapped_column(Boolean)
    # Where this key's runs may track (app/services/rules/tracking_rules.py): the MLflow experiment
    # and W&B project must start with `tracking_prefix`, the W&B entity is pinned.
    tracking_prefix: Mapped[str | None] = mapped_column(String(100))
    wandb_entity: Mapped[str | None] = mapped_column(String(100))


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_owner_created", "owner_id", "created_at"),
        # The scheduler's order: queued runs by priority, then when they (or their attempt)
        # were queued; fair share between keys is decided in app/services/scheduling.py.
        Index("ix_runs_status_queued", "status", "queued_at"),
        Index("ix_runs_status_priority", "status", "priority"),
        # One run per (principal, Idempotency-Key): concurrent retries cannot create two.
        UniqueConstraint("owner_id", "idempotency_key"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner_id: Mapped[str | None] = mapped_column(String(32), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True, default=RunStatus.QUEUED)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    # New attempts the service started after Ray lost a job, since creation or the last
    # resume by request; fault_tolerance.max_resubmits bounds it (app/services/lifecycle.py).
    resubmits: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    run_metadata: Mapped[dict[str, str]] = mapped_column("metadata", JSON, default=dict)
    # A run created as an OpenAI fine-tuning job (POST /v1/fine_tuning/jobs): the job's own
    # fields that the run's spec does not keep (file ids, suffix, hyperparameters as asked
    # and as resolved, method); app/services/openai_jobs.py. Null for other runs.
    openai_job: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # sha256 of the token of the current attempt's worker (new per attempt); app/security.py.
    callback_token_hash: Mapped[str | None] = mapped_column(String(64))
    ray_submission_id: Mapped[str | None] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    # sha256 of the canonical request body, to tell a retry from a different request.
    request_hash: Mapped[str | None] = mapped_column(String(64))
    error_code: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    epoch: Mapped[float | None] = mapped_column(Float)
    # A non-finite value as its kind's name ("nan", "inf", "-inf"): JSON holds no NaN.
    latest_metrics: Mapped[dict[str, float | str]] = mapped_column(JSON, default=dict)
    model_path: Mapped[str | None] = mapped_column(Text)
    latest_checkpoint: Mapped[str | None] = mapped_column(Text)
    # Why it stopped and its best checkpoint (app/services/run_result.py); None until then.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )
    # When the run, or its current attempt, entered the queue: the queue's order.
    queued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The request's scheduling fields (contract/run_request.py RunRequest).
    priority: Mapped[int] = mapped_column(Integer, default=50, server_default="50")
    preemptible: Mapped[bool] = mapped_column(Boolean, default=True, server_default=sa_true())
    # What the run asks of the cluster in all (workers x per worker), for quotas and fair
    # share without reading every queued run's spec.
    gpus: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # While queued: why it waits, as the scheduler's latest pass found (app/services/dispatch.py).
    queue_reason: Mapped[str | None] = mapped_column(Text)
    # When the current attempt began running (started_at is the first attempt's): how long
    # it has run, which a preemption must respect.
    attempt_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # While live: when the scheduler asked this attempt to checkpoint and stop, and why.
    # The worker reads it (GET /v1/internal/runs/{id}/control). Kept while the preempted
    # run waits in the queue again, cleared when a dispatcher claims it.
    preempt_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    preempt_reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    @property
    def run_status(self) -> RunStatus:
        return RunStatus(self.status)

    @property
    def definition(self) -> RunDefinition:
        """The stored spec, typed: what the run trains (metadata is kept beside it)."""
        return RunDefinition.of_resolved(self.spec)


class Metric(Base):
    __tablename__ = "metrics"
    # Stored once per (run, attempt, name, step): retried or out-of-order posts do no harm.
    __table_args__ = (UniqueConstraint("run_id", "attempt", "name", "step"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    # None when the value is not a finite number; `nonfinite` then says which
    # ("nan" | "inf" | "-inf"): neither SQLite's REAL nor JSON holds them.
    value: Mapped[float | None] = mapped_column(Float)
    nonfinite: Mapped[str | None] = mapped_column(String(4))
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "path"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[float | None] = mapped_column(Float)
    path: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))  # "deepspeed" | "hf" | "adapter"
    metrics: Mapped[dict[str, float | str]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))  # "status" | "message" | ...
    status: Mapped[str | None] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text, default="")
    # How many times in a row this same event happened (repeats are coalesced into one row).
    repeats: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # A startup_phase event's: which part of the attempt's start, and how long it took.
    phase: Mapped[str | None] = mapped_column(String(32))
    duration_seconds: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class File(Base):
    """An uploaded dataset file, checked record by record before it was stored."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner_id: Mapped[str] = mapped_column(String(32), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    format: Mapped[str] = mapped_column(String(16))  # "jsonl" | "csv" | "parquet"
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    records: Mapped[int] = mapped_column(Integer)
    fields: Mapped[list[str]] = mapped_column(JSON)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookDelivery(Base):
    """One notification of a run's event to one subscriber, queued in the transaction of the
    change that caused it and sent by app/services/webhook_delivery.py. Its id is the
    `Idempotency-Key` the receiver sees on every attempt."""

    __tablename__ = "webhook_deliveries"
    # The deliverer's query: pending rows whose time has come.
    __table_args__ = (Index("ix_webhook_deliveries_status_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(32))  # "run.succeeded", "run.checkpoint", ...
    url: Mapped[str] = mapped_column(Text)
    # To a service-wide subscriber (TUNEYARD_WEBHOOK_URLS), signed with the service's
    # secret; else to one of the run's own webhooks, signed with its owner key's secret.
    # A run's owner lists only its own hooks' deliveries.
    service_wide: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    # The body, as sent on every attempt (only the signature's timestamp changes).
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # When a pending delivery is next due; while an attempt is in flight, when its claim
    # lapses (a deliverer that died mid-send leaves it to another).
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_error: Mapped[str | None] = mapped_column(Text)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
