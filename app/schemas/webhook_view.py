"""A run's webhook deliveries as its owner reads them (GET /v1/runs/{id}/webhooks): those to
its own webhooks; the service-wide subscribers' are the operator's."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from app.schemas.run_view import as_utc
from app.storage.models import WebhookDelivery


class WebhookDeliveryView(BaseModel):
    id: str = Field(description="Sent as the `Idempotency-Key` header, the same on every attempt.")
    event: str = Field(examples=["run.succeeded"])
    url: str
    status: Literal["pending", "delivered", "failed"] = Field(
        description="pending: not yet delivered, retried with backoff; delivered: the "
        "receiver answered 2xx; failed: every attempt (TUNEYARD_WEBHOOK_MAX_ATTEMPTS) failed."
    )
    attempts: int
    last_status_code: int | None = Field(description="The receiver's last HTTP status.")
    last_error: str | None = Field(
        description="Why the last attempt failed, if it did, as a class only: `connection "
        "failed`, `timed out`, `refused: address not allowed`, `HTTP <status>`, `delivery "
        "failed`, `interrupted`."
    )
    created_at: datetime
    delivered_at: datetime | None
    next_attempt_at: datetime | None = Field(description="When a pending delivery is tried next.")

    @classmethod
    def of(cls, d: WebhookDelivery) -> WebhookDeliveryView:
        return cls(
            id=d.id,
            event=d.event,
            url=d.url,
            status=d.status,
            attempts=d.attempts,
            last_status_code=d.last_status_code,
            last_error=d.last_error,
            created_at=as_utc(d.created_at),
            delivered_at=as_utc(d.delivered_at),
            next_attempt_at=as_utc(d.next_attempt_at) if d.status == "pending" else None,
        )


class WebhookDeliveryList(BaseModel):
    object: str = "list"
    data: list[WebhookDeliveryView]
