"""OWASP API4 Unrestricted Resource Consumption, webhook delivery: one tenant's webhooks
cannot take the deliverer from the others.

Issue 39 found a URL the schema's pattern took (`http://a:b/`) on which httpx raises
`InvalidURL`, not an `httpx.HTTPError`: it escaped the per-delivery handler and ended the
whole tick. Nothing of the batch was recorded: the bad rows stayed `pending` forever, past
`max_attempts` (which only the recording checked), and another tenant's delivery in the
same batch reached its receiver, was answered 200, was never recorded, and was sent again
and again. And with one pool of four send threads, a tenant whose receivers hang held every
thread. The review of the fix found two more ways: httpx's timeout bounds each read, not a
send, so a receiver answering a byte at a time held its thread for ever, and the tick
claimed only what was due when it began, so nothing else went out until it ended; and the
answer's body was read whole, so a receiver's endless body filled the service's memory.
These tests try: such a URL at creation; rows that raise, beside another tenant's row, in
one tick; a claim that lapsed on its last attempt; a tenant's slow receivers beside another
tenant's fast one; receivers that trickle their answer's head or send an endless body; and
another tenant's delivery that falls due while a tick is held by them."""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.services import webhook_delivery
from app.services.webhook_delivery import SENDS_PER_OWNER, WebhookDeliverer
from app.settings import Settings
from app.storage.db import transaction
from app.storage.models import WebhookDelivery, new_id, utcnow
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


@pytest.mark.parametrize("how", ["unsendable-url", "the-send-raises"])
def test_rows_that_cannot_be_sent_are_recorded_beside_another_tenants_which_is_sent_once(
    how: str,
    client: TestClient,
    auth: dict[str, str],
    other: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    deliverer: WebhookDeliverer,
    receiver_b: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's reproduction: with four or more bad rows due, nothing else was sent; here
    five, older than tenant B's row, which comes due in the same tick. Their URL (stored
    before the rule) is refused before it reaches httpx, whose InvalidURL aborted the whole
    tick; and any exception a send raises (a bug: nothing a tenant sends provokes one now,
    so one is put in its way) is one row's failure too."""
    run_a = cancelled_run(client, auth, tmp_path, [])
    bad = add_unsendable(session_factory, run_a, 5)
    expected = "refused: URL not allowed"
    if how == "the-send-raises":
        expected = "delivery failed"

        def raising(url: str) -> str | None:
            if url == UNSENDABLE:  # tenant A's rows
                raise RuntimeError("a bug")
            return None

        monkeypatch.setattr(webhook_delivery, "webhook_url_problem", raising)
    run_b = cancelled_run(client, other, tmp_path, [{"url": receiver_b.url}])

    assert deliverer.tick() == 6
    [delivered] = deliveries(client, run_b, other)
    assert (delivered["status"], delivered["attempts"]) == ("delivered", 1)
    assert receiver_b.events() == ["run.cancelled"]
    for row in rows(session_factory, bad):
        # Recorded as a failed attempt, with its class, and due again later.
        assert (row.status, row.attempts, row.last_error) == ("pending", 1, expected)

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
        try:
            deliverer.tick()
        finally:
            deliverer.stop()
        # Each arrival is stamped when its receiver answers: A's only after their delay.
        assert len(receiver_b.received) == 1
        assert receiver_b.received[0].at < min(r.at for r in slow.received), (
            "B waited behind A's slow receiver"
        )
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


class _Trickling(socketserver.BaseRequestHandler):
    """Answers a request a byte every 0.1 s: the head (`server.head_only`), or a head that
    promises 10 GB and then the body."""

    def handle(self) -> None:
        self.request.recv(65536)
        self.server.connections += 1  # type: ignore[attr-defined]
        if self.server.head_only:  # type: ignore[attr-defined]
            answer = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 10_000
        else:
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
            answer = b"x" * 10_000
        try:
            for i in range(len(answer)):
                self.request.sendall(answer[i : i + 1])
                time.sleep(0.1)
        except OSError:
            pass  # the deliverer hung up: what the tests want
        self.server.hung_up.append(time.monotonic())  # type: ignore[attr-defined]


@pytest.fixture(params=["head", "body"])
def trickling(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[tuple[str, str], list[float]]]:
    """A trickling receiver: (its URL, what it trickles), and when each send to it ended."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Trickling)
    server.daemon_threads = True
    server.head_only = request.param == "head"  # type: ignore[attr-defined]
    server.connections = 0  # type: ignore[attr-defined]
    server.hung_up = []  # type: ignore[attr-defined]  # when each send ended, in order
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield (f"http://127.0.0.1:{server.server_address[1]}", request.param), server.hung_up  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def test_a_receiver_that_trickles_its_answer_holds_a_send_no_longer_than_the_timeout(
    client: TestClient,
    auth: dict[str, str],
    other: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    receiver_b: Receiver,
    trickling: tuple[tuple[str, str], list[float]],
) -> None:
    """Tenant A's receivers answer a byte at a time, each read well within httpx's read
    timeout: the head never ends, or a 10 GB body follows it. Each send ends by the
    timeout (3 s) in all; a head that never ends is recorded as timed out, a 200 whose
    body is endless as delivered at once, its body unread. Tenant B's delivery, made while
    A's trickling heads hold the tick, goes out before they end."""
    # Long enough that run B is made while A's sends are held, even on a loaded machine;
    # whether B beat them is read off the receivers' clocks, not a budget of ours.
    timeout_s = 3.0
    deliverer = WebhookDeliverer(
        settings=with_webhooks(settings, webhook_timeout_s=timeout_s),
        session_factory=session_factory,
    )
    (url, trickled), hung_up = trickling
    hooks_a = [{"url": f"{url}/{i}"} for i in range(SENDS_PER_OWNER)]
    run_a = cancelled_run(client, auth, tmp_path, hooks_a)
    started = time.monotonic()
    ticking = threading.Thread(target=deliverer.tick)
    ticking.start()
    try:
        if trickled == "head":
            time.sleep(0.3)  # A's sends are under way (the receiver holds them)...
            run_b = cancelled_run(client, other, tmp_path, [{"url": receiver_b.url}])
            while not receiver_b.received and ticking.is_alive():  # ...and B's goes out
                time.sleep(0.01)
    finally:
        ticking.join(timeout=60)
        deliverer.stop()
    assert not ticking.is_alive()
    # One round of A's sends, each cut at the timeout (not the receiver's 1,000 s).
    assert time.monotonic() - started < timeout_s + 3
    if trickled == "head":
        # B's, due after the tick began, went out in that tick before any of A's ended.
        assert receiver_b.received, "B's delivery waited for a later tick"
        # The receiver sees a hang-up at its next byte, up to 0.1 s after the deliverer's.
        deadline = time.monotonic() + 10
        while len(hung_up) < SENDS_PER_OWNER and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(hung_up) == SENDS_PER_OWNER
        assert receiver_b.received[0].at < min(hung_up), "B waited for A's sends"
    outcomes = {(d["status"], d["last_error"]) for d in deliveries(client, run_a, auth)}
    if trickled == "head":
        # Retried later (max_attempts 3); timed out is what it records.
        assert outcomes == {("pending", "timed out")}, outcomes
        assert [d["status"] for d in deliveries(client, run_b, other)] == ["delivered"]
    else:
        assert outcomes == {("delivered", None)}, outcomes
