"""The deliverer: a background thread that POSTs due webhook deliveries, signed, and retries
the ones that fail with exponential backoff and jitter.

A delivery is claimed before it is sent: in one short transaction the due rows are locked
(`FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite's write transactions are serial) and each is
taken by a compare-and-set on its attempt count, which also pushes its due time past the
send's timeout. So two service replicas never send one delivery at once, and a deliverer
that dies mid-send leaves the row to be sent again, under the same Idempotency-Key, once
that claim lapses. The HTTP request itself runs outside any transaction.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.background import TickLoop
from app.db import transaction
from app.models import WebhookDelivery, utcnow
from app.services.webhooks import (
    DELIVERED,
    FAILED,
    IDEMPOTENCY_HEADER,
    PENDING,
    SIGNATURE_HEADER,
    USER_AGENT,
    body_of,
    sign,
)
from app.settings import Settings

log = logging.getLogger("tuneyard")

# Deliveries sent at once: a receiver that hangs until the timeout holds up one of them.
SEND_THREADS = 4
# A claim outlasts the send's timeout by this much before another deliverer may retry it.
CLAIM_MARGIN_S = 30.0
MAX_RETRY_DELAY_S = 3600.0
# What of a failure is kept: enough to say why, never the receiver's whole answer.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class Claimed:
    id: str
    run_id: str
    url: str
    payload: dict[str, Any]
    attempts: int  # including this one


@dataclass(frozen=True, slots=True)
class Outcome:
    status_code: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def retry_delay_s(attempts: int, *, base_s: float, rng: random.Random | None = None) -> float:
    """How long after its `attempts`-th failed attempt a delivery is tried again: base,
    2 * base, 4 * base ... capped, with the upper half jittered so that a receiver that comes
    back is not met by every delivery at once."""
    ceiling = min(base_s * 2 ** (attempts - 1), MAX_RETRY_DELAY_S)
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


class WebhookDeliverer(TickLoop):
    name = "tuneyard-webhooks"

    def __init__(self, *, settings: Settings, session_factory: sessionmaker[Session]) -> None:
        if settings.webhook_secret is None:
            raise ValueError("the webhook deliverer needs TUNEYARD_WEBHOOK_SECRET")
        self.settings = settings
        self.session_factory = session_factory
        self._secret = settings.webhook_secret.get_secret_value()
        # Redirects are not followed: a delivery goes to the URL its subscriber gave.
        self._http = httpx.Client(
            timeout=settings.webhook_timeout_s,
            follow_redirects=False,
            headers={"User-Agent": USER_AGENT},
        )
        self._pool = ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="tuneyard-webhook")
        super().__init__(
            interval_s=settings.webhook_poll_interval_s,
            join_timeout_s=settings.webhook_timeout_s + 5,
        )

    def stop(self) -> None:
        super().stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def tick(self) -> int:
        """Send every delivery due now, each once; how many were attempted. A retry falls
        due after now, so it waits for a later tick."""
        due_by = utcnow()
        attempted = 0
        while not self._stop.is_set():
            claimed = self.claim_due(due_by=due_by, limit=SEND_THREADS)
            if not claimed:
                break
            outcomes = list(self._pool.map(self._send, claimed))
            for delivery, outcome in zip(claimed, outcomes, strict=True):
                self._record(delivery, outcome)
            attempted += len(claimed)
        return attempted

    # -- claim, send, record ------------------------------------------------------------

    def claim_due(self, *, due_by: datetime, limit: int) -> list[Claimed]:
        lapse = utcnow() + timedelta(seconds=self.settings.webhook_timeout_s + CLAIM_MARGIN_S)
        claimed: list[Claimed] = []
        with transaction(self.session_factory) as session:
            due = session.execute(
                select(WebhookDelivery.id, WebhookDelivery.attempts)
                .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= due_by)
                .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).all()
            for delivery_id, attempts in due:
                taken = session.execute(
                    update(WebhookDelivery)
                    .where(
                        WebhookDelivery.id == delivery_id,
                        WebhookDelivery.status == PENDING,
                        WebhookDelivery.attempts == attempts,
                    )
                    .values(attempts=attempts + 1, next_attempt_at=lapse)
                    .execution_options(synchronize_session=False)
                )
                if taken.rowcount != 1:  # type: ignore[attr-defined]
                    continue  # a peer took it
                row = session.execute(
                    select(
                        WebhookDelivery.run_id, WebhookDelivery.url, WebhookDelivery.payload
                    ).where(WebhookDelivery.id == delivery_id)
                ).one()
                claimed.append(Claimed(delivery_id, row.run_id, row.url, row.payload, attempts + 1))
        return claimed

    def _send(self, delivery: Claimed) -> Outcome:
        body = body_of(delivery.payload)
        headers = {
            "Content-Type": "application/json",
            IDEMPOTENCY_HEADER: delivery.id,
            SIGNATURE_HEADER: sign(self._secret, int(time.time()), body),
        }
        try:
            response = self._http.post(delivery.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return Outcome(None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
        if 200 <= response.status_code < 300:
            return Outcome(response.status_code, None)
        return Outcome(response.status_code, f"HTTP {response.status_code}")

    def _record(self, delivery: Claimed, outcome: Outcome) -> None:
        now = utcnow()
        values: dict[str, Any] = {
            "last_status_code": outcome.status_code,
            "last_error": outcome.error,
        }
        if outcome.ok:
            values.update(status=DELIVERED, delivered_at=now)
        elif delivery.attempts >= self.settings.webhook_max_attempts:
            values.update(status=FAILED)
        else:
            delay = retry_delay_s(delivery.attempts, base_s=self.settings.webhook_retry_base_s)
            values.update(next_attempt_at=now + timedelta(seconds=delay))
        with transaction(self.session_factory) as session:
            # Only while the claim is this deliverer's: after a claim lapsed, a peer's later
            # attempt owns the row.
            session.execute(
                update(WebhookDelivery)
                .where(
                    WebhookDelivery.id == delivery.id,
                    WebhookDelivery.status == PENDING,
                    WebhookDelivery.attempts == delivery.attempts,
                )
                .values(**values)
                .execution_options(synchronize_session=False)
            )
        level = logging.INFO if outcome.ok else logging.WARNING
        log.log(
            level,
            "webhook %s to %s, attempt %d: %s",
            delivery.id,
            # The host only: a webhook URL often carries its receiver's token.
            httpx.URL(delivery.url).host,
            delivery.attempts,
            "delivered" if outcome.ok else outcome.error,
            extra={"run_id": delivery.run_id},
        )
