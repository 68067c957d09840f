"""OWASP API4 Unrestricted Resource Consumption, webhook delivery: one tenant's webhooks
cannot take the deliverer from the others.

Issue 39 found a URL the schema's pattern took (`http://a:b/`) on which httpx raises
`InvalidURL`, not an `httpx.HTTPError`: it escaped the per-delivery handler and ended the
whole tick. Nothing of the batch was recorded: the bad rows stayed `pending` forever, past
`max_attempts` (which only the recording checked), and another tenant's delivery in the
same batch reached its receiver, was answered 200, was never recorded, and was sent again
and again. And with one pool of four send threads, a tenant whose receivers hang held every
thread. These tests try: such a URL at creation; rows that raise, beside another tenant's
row, in one tick; a claim that lapsed on its last attempt; and a tenant's slow receivers
beside another tenant's fast one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.db import transaction
from app.models import WebhookDelivery, new_id, utcnow
from app.services.webhook_delivery import SENDS_PER_OWNER, WebhookDeliverer
from app.settings import Settings
from tests.app.test_webhooks import (
    Receiver,
    deliver_until,
    deliveries,
    receiving,
    with_webhooks,
)
from tests.conftest import make_api_key
from tests.factories import run_request

# A URL on which httpx raises InvalidURL (a port that is no number), as stored before the rule.
UNSENDABLE = "http://a:b/"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return with_webhooks(settings)


@pytest.fixture
def deliverer(
    settings: Settings, session_factory: sessionmaker[Session]
) -> Iterator[WebhookDeliverer]:
    made = WebhookDeliverer(settings=settings, session_factory=session_factory)
    yield made
    made.stop()


@pytest.fixture
def other(session_factory: sessionmaker[Session]) -> dict[str, str]:
    """Another tenant's key."""
    return {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}


def cancelled_run(
    client: TestClient, auth: dict[str, str], root: Path, hooks: list[dict[str, Any]]
) -> str:
    """A run with `hooks`, cancelled while queued: one `run.cancelled` delivery per hook."""
    created = client.post("/v1/runs", json=run_request(root, webhooks=hooks), headers=auth)
    assert created.status_code == 201, created.text
    run_id: str = created.json()["id"]
    assert client.post(f"/v1/runs/{run_id}/cancel", headers=auth).status_code == 200
    return run_id


def add_unsendable(session_factory: sessionmaker[Session], run_id: str, count: int) -> list[str]:
    """Deliveries of `run_id` to UNSENDABLE, due now, as a run made before the URL rule has."""
    now = utcnow()
    ids = [new_id("whd") for _ in range(count)]
    with transaction(session_factory) as session:
        for delivery_id in ids:
            session.add(
                WebhookDelivery(
                    id=delivery_id,
                    run_id=run_id,
                    event="run.cancelled",
                    url=UNSENDABLE,
                    payload={"id": delivery_id, "type": "run.cancelled", "data": {}},
                    status="pending",
                    attempts=0,
                    next_attempt_at=now,
                    created_at=now,
                )
            )
    return ids


def rows(session_factory: sessionmaker[Session], ids: list[str]) -> list[WebhookDelivery]:
    with session_factory() as session:
        return list(session.scalars(select(WebhookDelivery).where(WebhookDelivery.id.in_(ids))))


def test_a_url_httpx_cannot_send_to_is_refused_when_the_run_is_made(
    client: TestClient, auth: dict[str, str], tmp_path: Path
) -> None:
    for url in (UNSENDABLE, "http://hooks.example:99999/", "http://exa%00mple.com/"):
        body = run_request(tmp_path, webhooks=[{"url": url}])
        created = client.post("/v1/runs", json=body, headers=auth)
        assert created.status_code == 422, (url, created.text)
        assert [p["field"] for p in created.json()["detail"]] == ["webhooks.0.url"]
    assert client.get("/v1/runs", headers=auth).json()["data"] == []


def test_rows_that_raise_are_recorded_beside_another_tenants_which_is_sent_once(
    client: TestClient,
    auth: dict[str, str],
    other: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    deliverer: WebhookDeliverer,
    receiver_b: Receiver,
) -> None:
    """The issue's reproduction: with four or more bad rows due, nothing else was sent; here
    five, older than tenant B's row, which comes due in the same tick."""
    run_a = cancelled_run(client, auth, tmp_path, [])
    bad = add_unsendable(session_factory, run_a, 5)
    run_b = cancelled_run(client, other, tmp_path, [{"url": receiver_b.url}])

    assert deliverer.tick() == 6
    [delivered] = deliveries(client, run_b, other)
    assert (delivered["status"], delivered["attempts"]) == ("delivered", 1)
    assert receiver_b.events() == ["run.cancelled"]
    for row in rows(session_factory, bad):
        # Recorded as a failed attempt, with its class, and due again later.
        assert (row.status, row.attempts, row.last_error) == ("pending", 1, "delivery failed")

    deliver_until(deliverer, lambda: {r.status for r in rows(session_factory, bad)} == {"failed"})
    assert {r.attempts for r in rows(session_factory, bad)} == {3}  # webhook_max_attempts
    assert receiver_b.events() == ["run.cancelled"]  # recorded, so never sent again
    assert deliverer.tick() == 0


def test_a_claim_that_lapsed_on_its_last_attempt_is_failed_not_sent_again(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    deliverer: WebhookDeliverer,
    receiver_b: Receiver,
) -> None:
    """A deliverer that died during the last attempt left no outcome; when its claim lapses
    the row is due again with every attempt spent."""
    run_id = cancelled_run(client, auth, tmp_path, [{"url": receiver_b.url}])
    with transaction(session_factory) as session:
        session.execute(update(WebhookDelivery).values(attempts=3))  # webhook_max_attempts
    assert deliverer.tick() == 0
    assert receiver_b.received == []
    [given_up] = deliveries(client, run_id, auth)
    assert (given_up["status"], given_up["attempts"]) == ("failed", 3)
    assert given_up["last_error"] == "interrupted"


def test_a_tenants_slow_receivers_hold_its_own_share_of_the_threads(
    client: TestClient,
    auth: dict[str, str],
    other: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    receiver_b: Receiver,
) -> None:
    """Tenant A's receiver answers after 2.5 s (within the timeout); its four deliveries are
    older than tenant B's. B's is sent at once, while A's are still held."""
    patient = with_webhooks(settings, webhook_timeout_s=5.0)
    deliverer = WebhookDeliverer(settings=patient, session_factory=session_factory)
    with receiving() as slow:
        slow.delay_s = 2.5
        hooks_a = [{"url": f"{slow.url}/{i}"} for i in range(4)]
        run_a = cancelled_run(client, auth, tmp_path, hooks_a)
        run_b = cancelled_run(client, other, tmp_path, [{"url": receiver_b.url}])

        started = time.monotonic()
        ticking = threading.Thread(target=deliverer.tick)
        ticking.start()
        try:
            while not receiver_b.received:
                assert time.monotonic() - started < 2.0, "B waited behind A's slow receiver"
                time.sleep(0.01)
            assert slow.received == []  # A's sends are still held by its receiver
        finally:
            ticking.join(timeout=30)
            deliverer.stop()
        # A's four went SENDS_PER_OWNER at a time: two rounds of its receiver's delay.
        assert len(hooks_a) == 2 * SENDS_PER_OWNER
        assert time.monotonic() - started >= 2 * slow.delay_s
        assert len(slow.received) == 4
    assert {d["status"] for d in deliveries(client, run_a, auth)} == {"delivered"}
    assert [d["status"] for d in deliveries(client, run_b, other)] == ["delivered"]


@pytest.fixture
def receiver_b() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder
