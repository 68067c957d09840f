"""Webhooks: a run's events queued for its subscribers, and how each delivery is signed.

A delivery is a row added in the transaction of the change that caused it: a rolled-back
change sends nothing, a committed one is never lost, and a restarted service still has it.
The deliverer (app/services/webhook_delivery.py) sends the rows.

Receivers check `Tuneyard-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`
over the raw body, as Stripe's scheme does, and drop repeats by `Idempotency-Key` (the
delivery's id, the same on every attempt). A run's own webhooks are signed with its owner
key's secret (`ApiKey.webhook_secret`, shown once when the key is made or the secret
rotated), so that no tenant can sign what another tenant's receiver accepts; service-wide
subscribers (and the hooks of a run without an owner key) with `TUNEYARD_WEBHOOK_SECRET`.

A payload shows the run without its webhooks: a receiver learns nothing of the other
receivers' URLs (which may carry tokens), a service-wide subscriber nothing of any tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.schemas.run_view import RunView
from app.services.rules.webhook_rules import WebhookConfig
from app.storage.models import Run, WebhookDelivery, new_id, utcnow

SIGNATURE_HEADER = "Tuneyard-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
USER_AGENT = "tuneyard-webhooks"
# How old a signature `verify` accepts by default: a replayed delivery is refused after it.
DEFAULT_TOLERANCE_S = 300

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


def subscribers(config: WebhookConfig, run: Run, event: str) -> list[tuple[str, bool]]:
    """The URLs that asked for `event` of `run`, each with whether it is service-wide: its
    own webhooks, then the service's, each URL once of each kind. A URL of both kinds gets
    both deliveries: each is signed with another secret."""
    own = [h["url"] for h in run.spec.get("webhooks") or [] if event in h.get("events", ())]
    service_wide = list(config.urls) if event in config.events else []
    return [(url, False) for url in dict.fromkeys(own)] + [
        (url, True) for url in dict.fromkeys(service_wide)
    ]


def enqueue_webhooks(
    session: Session,
    run: Run,
    event_type: str,
    data: Mapping[str, Any] | None = None,
    *,
    hooks: WebhookConfig,
) -> list[WebhookDelivery]:
    """One pending delivery per subscriber of `event_type`, in the caller's transaction.
    `data` joins the run's public view in the payload's `data`; `hooks`: the service's
    webhook settings (its subscribers)."""
    urls = subscribers(hooks, run, event_type)
    if not urls:
        return []
    # The view reads columns a flush fills in (a new row's created_at).
    session.flush()
    view = RunView.of(run).model_dump(mode="json")
    # Every receiver would see every other's URL (and the tokens URLs carry).
    view["spec"].pop("webhooks", None)
    now = utcnow()
    deliveries = []
    for url, service_wide in urls:
        delivery_id = new_id("whd")
        payload = {
            "id": delivery_id,
            "type": event_type,
            "created_at": now.isoformat(),
            "data": {"run": view, **(data or {})},
        }
        delivery = WebhookDelivery(
            id=delivery_id,
            run_id=run.id,
            event=event_type,
            url=url,
            service_wide=service_wide,
            payload=payload,
            status=PENDING,
            attempts=0,
            next_attempt_at=now,
            created_at=now,
        )
        session.add(delivery)
        deliveries.append(delivery)
    return deliveries


def list_deliveries(session: Session, *, run: Run) -> list[WebhookDelivery]:
    """The deliveries to the run's own webhooks: those to service-wide subscribers are the
    operator's (their URLs may carry tokens, their outcomes are the operator's network's)."""
    return list(
        session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.run_id == run.id, WebhookDelivery.service_wide.is_(False))
            .order_by(WebhookDelivery.created_at, WebhookDelivery.id)
        )
    )


# -- signing --------------------------------------------------------------------------------


def body_of(payload: Mapping[str, Any]) -> bytes:
    """The bytes sent for a payload: the same on every attempt."""
    return json.dumps(payload, separators=(",", ":")).encode()


def _digest(secret: str, timestamp: int, body: bytes) -> str:
    signed = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The `Tuneyard-Signature` header's value for `body` sent at `timestamp` (unix s)."""
    return f"t={timestamp},v1={_digest(secret, timestamp, body)}"


def verify(
    secret: str,
    header: str,
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> bool:
    """Whether `header` (a `Tuneyard-Signature` value) signs the raw `body` with `secret`, at
    a time no further than `tolerance_s` from `now`. Compared in constant time."""
    parts: dict[str, list[str]] = {}
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if sep:
            parts.setdefault(key, []).append(value)
    try:
        timestamp = int(parts["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = _digest(secret, timestamp, body)
    # Several v1 values are allowed, as while a secret is being rotated.
    return any(hmac.compare_digest(expected, candidate) for candidate in parts.get("v1", []))
