"""The deliverer: a background thread that POSTs due webhook deliveries, signed, and retries
the ones that fail with exponential backoff and jitter.

A delivery is claimed before it is sent: in one short transaction the due rows are locked
(`FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite's write transactions are serial) and each is
taken by a compare-and-set on its attempt count, which also pushes its due time past the
send's timeout. So two service replicas never send one delivery at once, and a deliverer
that dies mid-send leaves the row to be sent again, under the same Idempotency-Key, once
that claim lapses. The HTTP request itself runs outside any transaction.

Each API key (a run's owner) has its own share of the send threads: one deliverer has at
most SENDS_PER_OWNER of a key's deliveries in flight, and a claim takes no more of a key's
due rows than that leaves room for. So a receiver that hangs until the timeout holds its
own tenant's threads, and the other tenants' deliveries go on past it.

A delivery that fails in any way, an exception of any kind included, is recorded as
retried or failed, never left pending; a claim that lapsed without an outcome (a deliverer
that died mid-send) counts as an attempt, and past TUNEYARD_WEBHOOK_MAX_ATTEMPTS the row is
failed rather than sent again. What a failure records is its class ("connection failed",
"timed out", "refused: address not allowed", "refused: URL not allowed", "HTTP 503"),
never an exception's text: the tenant reads it, and the details would describe a network it
may not reach.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from app.background import TickLoop
from app.services.rules.webhook_addresses import (
    REFUSED,
    AddressRefused,
    guarded_transport,
)
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
from app.storage.db import transaction
from app.storage.models import ApiKey, Run, WebhookDelivery, utcnow
from contract.run_request import webhook_url_problem

log = logging.getLogger("tuneyard")

# Deliveries sent at once: a receiver that hangs until the timeout holds up one of them.
SEND_THREADS = 8
# Of them, one key's at most (per deliverer): a tenant's slow receivers hold its share only.
SENDS_PER_OWNER = 2
# A claim outlasts the send's timeout by this much before another deliverer may retry it.
CLAIM_MARGIN_S = 30.0
MAX_RETRY_DELAY_S = 3600.0
# The classes of failure a delivery records, besides REFUSED and "HTTP <status>".
TIMED_OUT = "timed out"
CONNECTION_FAILED = "connection failed"
# A stored URL the rule refuses now (credentials in it, one httpx cannot send to).
REFUSED_URL = "refused: URL not allowed"
# Anything else: a bug. The log has the exception's type.
DELIVERY_FAILED = "delivery failed"
# Claimed on its last attempt, and never recorded: given up when the claim lapsed.
INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class Claimed:
    id: str
    run_id: str
    owner: str  # the run's owner key ("" if none): whose share of the threads it takes
    url: str
    payload: dict[str, Any]
    attempts: int  # including this one
    service_wide: bool
    secret: str = field(repr=False)  # signs it


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


def _host_of(url: str) -> str:
    """The host only, for the log: a webhook URL often carries its receiver's token."""
    try:
        return httpx.URL(url).host or "?"
    except Exception:
        return "(a URL that does not parse)"


class WebhookDeliverer(TickLoop):
    name = "tuneyard-webhooks"

    def __init__(
        self,
        *,
        settings: Settings,
        session_factory: sessionmaker[Session],
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """`verify`: what receivers' certificates are checked against (httpx's default CA
        bundle; a test's own CA)."""
        if settings.webhook_secret is None:
            raise ValueError("the webhook deliverer needs TUNEYARD_WEBHOOK_SECRET")
        self.settings = settings
        self.session_factory = session_factory
        self._secret = settings.webhook_secret.get_secret_value()
        # Redirects are not followed: a delivery goes to the URL its subscriber gave.
        options: dict[str, Any] = {
            "timeout": settings.webhook_timeout_s,
            "follow_redirects": False,
            "headers": {"User-Agent": USER_AGENT},
            "verify": verify,
        }
        # Runs' own webhooks: every connection meets the address rule, to the address checked;
        # never through the environment's proxies (httpx would mount them past the transport,
        # and a proxy resolves the name itself).
        policy = settings.webhook_config().addresses
        self._http = httpx.Client(
            transport=guarded_transport(policy, verify=verify, total_s=settings.webhook_timeout_s),
            trust_env=False,
            **options,
        )
        # Service-wide subscribers are the operator's choice, on its own network maybe: no
        # address rule, and the environment's proxies as for any client.
        self._operator_http = httpx.Client(**options)
        self._pool = ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="tuneyard-webhook")
        super().__init__(
            interval_s=settings.webhook_poll_interval_s,
            join_timeout_s=settings.webhook_timeout_s + 5,
        )

    def stop(self) -> None:
        super().stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        self._operator_http.close()

    def tick(self) -> int:
        """Send every delivery due, each once; how many were attempted. As each send ends,
        its key has room again and more is claimed, of what is due by then: a key's slow
        receiver holds its own share of the threads while the others' deliveries go on,
        those that fell due while it was slow included. A delivery retried within the tick
        waits for a later one."""
        attempted: set[str] = set()
        in_flight: dict[Future[None], Claimed] = {}
        while True:
            room = SEND_THREADS - len(in_flight)
            claimed: list[Claimed] = []
            if room and not self._stop.is_set():
                busy = Counter(delivery.owner for delivery in in_flight.values())
                claimed = self.claim_due(
                    due_by=utcnow(), limit=room, busy=busy, skip=frozenset(attempted)
                )
                for delivery in claimed:
                    in_flight[self._pool.submit(self._deliver, delivery)] = delivery
                attempted.update(delivery.id for delivery in claimed)
            if not in_flight:
                return len(attempted)
            if claimed:
                continue  # a key whose share is now taken leaves room for the next key's
            # Woken by a send that ends, or by the poll interval: what fell due meanwhile
            # (another key's) is claimed while this key's slow sends go on.
            done, _ = wait(
                in_flight,
                timeout=self.settings.webhook_poll_interval_s,
                return_when=FIRST_COMPLETED,
            )
            for future in done:
                delivery = in_flight.pop(future)
                if not future.cancelled() and (exc := future.exception()) is not None:
                    # Recording failed (the database): the claim lapses and it is tried again.
                    log.error(
                        "webhook %s: its outcome was not recorded (%s)",
                        delivery.id,
                        type(exc).__name__,
                        extra={"run_id": delivery.run_id},
                    )

    # -- claim, send, record ------------------------------------------------------------

    def claim_due(
        self,
        *,
        due_by: datetime,
        limit: int,
        busy: Mapping[str, int] | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> list[Claimed]:
        """Claim up to `limit` deliveries due by `due_by`, oldest first, none of `skip`, and
        of each owner key no more than SENDS_PER_OWNER less its `busy` ones (in flight here
        already)."""
        busy = busy or {}
        room = {owner: SENDS_PER_OWNER - n for owner, n in busy.items()}
        lapse = utcnow() + timedelta(seconds=self.settings.webhook_timeout_s + CLAIM_MARGIN_S)
        owner = func.coalesce(Run.owner_id, "")
        due = [WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= due_by]
        if skip:
            due.append(WebhookDelivery.id.not_in(skip))
        if full := [key for key, left in room.items() if left <= 0]:
            # The rows of keys whose share is taken stay for a later claim, and the rows
            # behind them, other keys', are claimed now.
            due.append(owner.not_in(full))
        claimed: list[Claimed] = []
        with transaction(self.session_factory) as session:
            rows = session.execute(
                select(
                    WebhookDelivery.id,
                    WebhookDelivery.run_id,
                    WebhookDelivery.attempts,
                    owner.label("owner"),
                )
                .join(Run, Run.id == WebhookDelivery.run_id)
                .where(*due)
                .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                .limit(limit)
                .with_for_update(skip_locked=True, of=WebhookDelivery)
            ).all()
            for delivery_id, run_id, attempts, owner_id in rows:
                if len(claimed) >= limit:
                    break
                if attempts >= self.settings.webhook_max_attempts:
                    self._give_up(session, delivery_id, run_id, attempts)
                    continue
                if room.get(owner_id, SENDS_PER_OWNER) <= 0:
                    continue
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
                room[owner_id] = room.get(owner_id, SENDS_PER_OWNER) - 1
                claimed.append(self._claimed(session, delivery_id, owner_id, attempts + 1))
        return claimed

    def _claimed(self, session: Session, delivery_id: str, owner: str, attempts: int) -> Claimed:
        row = session.execute(
            select(
                WebhookDelivery.run_id,
                WebhookDelivery.url,
                WebhookDelivery.payload,
                WebhookDelivery.service_wide,
                ApiKey.webhook_secret,
            )
            .join(Run, Run.id == WebhookDelivery.run_id)
            .outerjoin(ApiKey, ApiKey.id == Run.owner_id)
            .where(WebhookDelivery.id == delivery_id)
        ).one()
        # A run's own hooks: its owner key's secret. The service's for its subscribers, and
        # for a run with no key of its own (auth disabled) or a key from before the secrets.
        secret = row.webhook_secret if not row.service_wide and row.webhook_secret else None
        return Claimed(
            id=delivery_id,
            run_id=row.run_id,
            owner=owner,
            url=row.url,
            payload=row.payload,
            attempts=attempts,
            service_wide=row.service_wide,
            secret=secret or self._secret,
        )

    def _give_up(self, session: Session, delivery_id: str, run_id: str, attempts: int) -> None:
        """A row claimed for its last attempt whose outcome was never recorded."""
        session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.status == PENDING,
                WebhookDelivery.attempts == attempts,
            )
            .values(
                status=FAILED, last_error=func.coalesce(WebhookDelivery.last_error, INTERRUPTED)
            )
            .execution_options(synchronize_session=False)
        )
        log.warning(
            "webhook %s: no outcome of its last attempt; failed",
            delivery_id,
            extra={"run_id": run_id},
        )

    def _deliver(self, delivery: Claimed) -> None:
        """Send and record one delivery, on a send thread."""
        try:
            outcome = self._send(delivery)
        except Exception as exc:
            log.warning(
                "webhook %s to %s, attempt %d: %s",
                delivery.id,
                _host_of(delivery.url),
                delivery.attempts,
                type(exc).__name__,
                extra={"run_id": delivery.run_id},
            )
            outcome = Outcome(None, DELIVERY_FAILED)
        self._record(delivery, outcome)

    def _send(self, delivery: Claimed) -> Outcome:
        body = body_of(delivery.payload)
        headers = {
            "Content-Type": "application/json",
            IDEMPOTENCY_HEADER: delivery.id,
            SIGNATURE_HEADER: sign(delivery.secret, int(time.time()), body),
        }
        if not delivery.service_wide and webhook_url_problem(delivery.url) is not None:
            # A run stored before the URL rule tightened (credentials in the URL, which httpx
            # would send as a tenant-chosen Authorization header): refused here as well.
            return Outcome(None, REFUSED_URL)
        client = self._operator_http if delivery.service_wide else self._http
        try:
            # The answer's status is all a delivery needs: its body is never read (a
            # receiver's endless body would fill the service's memory), and closing the
            # answer unread closes its connection.
            with client.stream("POST", delivery.url, content=body, headers=headers) as response:
                status = response.status_code
        except AddressRefused:
            return Outcome(None, REFUSED)
        except httpx.TimeoutException:
            return Outcome(None, TIMED_OUT)
        except httpx.TransportError:
            return Outcome(None, CONNECTION_FAILED)
        if 200 <= status < 300:
            return Outcome(status, None)
        return Outcome(status, f"HTTP {status}")

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
            _host_of(delivery.url),
            delivery.attempts,
            "delivered" if outcome.ok else outcome.error,
            extra={"run_id": delivery.run_id},
        )
