"""Webhooks: signed deliveries of a run's events to a real HTTP receiver on loopback (which
the service admits with TUNEYARD_WEBHOOK_ALLOWED_NETWORKS, as an operator would a private
receiver), queued in the database with the change that caused them, retried with backoff,
claimed by one deliverer at a time, and listed per run."""

from __future__ import annotations

import hashlib
import hmac
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.ports import free_port
from app.security import hash_secret
from app.services import lifecycle
from app.services.lifecycle import Failure
from app.services.rules.webhook_rules import WebhookConfig
from app.services.webhook_delivery import WebhookDeliverer, retry_delay_s
from app.services.webhooks import sign, verify
from app.settings import Settings
from app.storage.db import make_engine, make_session_factory, transaction
from app.storage.models import ApiKey, Run, WebhookDelivery
from contract.job_env import SPEC_ENV
from contract.statuses import RunStatus
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import post_status, run_location, worker_headers
from tests.conftest import make_api_key
from tests.factories import run_request

# The webhook settings the lifecycle tells a run's end by: a service without service-wide
# subscribers (a run's own webhooks are its spec's).
HOOKS = WebhookConfig()

SECRET = "whsec-test-0123456789abcdef"
TERMINAL = ["run.succeeded", "run.failed", "run.cancelled"]


# -- a receiver on loopback -----------------------------------------------------------------


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    answered: int
    at: float = field(default_factory=time.monotonic)  # when it arrived (monotonic clock)

    @property
    def payload(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.body)
        return result

    @property
    def key(self) -> str:
        return self.headers["idempotency-key"]


@dataclass
class Receiver:
    """Records every POST; answers the codes in `script` in turn, then 200."""

    url: str = ""
    script: list[int] = field(default_factory=list)
    delay_s: float = 0.0
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, headers: dict[str, str], body: bytes) -> int:
        with self.lock:
            code = self.script.pop(0) if self.script else 200
            self.received.append(Received(headers, body, code))
        return code

    def events(self) -> list[str]:
        return [r.payload["type"] for r in self.received]


@contextmanager
def receiving(tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    """A real HTTP receiver on loopback (HTTPS with `tls`, a server context), for as long as
    the block runs."""
    recorder = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if recorder.delay_s:
                time.sleep(recorder.delay_s)
            code = recorder.answer({k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    scheme = "http" if tls is None else "https"
    recorder.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/hooks"
    try:
        yield recorder
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder


# -- the service, its runs and its deliverer ------------------------------------------------


def with_webhooks(settings: Settings, **overrides: Any) -> Settings:
    return Settings(
        home=settings.home,
        database_url=settings.database_url,
        allowed_roots=settings.allowed_roots,
        **{
            "webhook_secret": SECRET,
            # The receivers here are on loopback, which webhooks may reach only when allowed.
            "webhook_allowed_networks": "127.0.0.0/8",
            # Small, so that retries fall due within the test.
            "webhook_retry_base_s": 0.01,
            "webhook_max_attempts": 3,
            "webhook_timeout_s": 2.0,
            "webhook_poll_interval_s": 0.02,
            **overrides,
        },
    )


def webhook_secret_of(session_factory: sessionmaker[Session], api_key: str) -> str:
    """The webhook signing secret of the key `api_key` (shown to its holder when made)."""
    with session_factory() as session:
        secret = session.scalars(
            select(ApiKey.webhook_secret).where(ApiKey.key_hash == hash_secret(api_key))
        ).one()
    assert secret is not None
    return secret


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return with_webhooks(settings)


@pytest.fixture
def deliverer(settings: Settings, session_factory: sessionmaker[Session]) -> Iterator[Any]:
    made = WebhookDeliverer(settings=settings, session_factory=session_factory)
    yield made
    made.stop()


def start_run(
    client: TestClient,
    auth: dict[str, str],
    root: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    webhooks: list[dict[str, Any]],
) -> tuple[str, dict[str, str]]:
    """A run with `webhooks`, dispatched to a recording Ray: its id and its worker's headers."""
    r = client.post("/v1/runs", json=run_request(root, webhooks=webhooks), headers=auth)
    assert r.status_code == 201, r.text
    ray = dispatch_to(ScriptedRay(), settings, session_factory)
    env_vars = ray.submitted[-1]["runtime_env"]["env_vars"]
    # The URLs (which may carry tokens) stay with the service, out of the job's environment.
    assert all(hook["url"] not in "".join(env_vars.values()) for hook in webhooks)
    assert json.loads(env_vars[SPEC_ENV])["webhooks"] == []
    return r.json()["id"], worker_headers(ray)


def succeed(client: TestClient, run_id: str, worker: dict[str, str]) -> None:
    post_status(client, run_id, worker, "running", check=True)
    post_status(client, run_id, worker, "succeeded", check=True)


def deliver_until(
    deliverer: WebhookDeliverer, done: Callable[[], bool], *, timeout_s: float = 10
) -> None:
    """Ticks, as the deliverer's thread would, until `done` (retries fall due in ms)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not delivered in time"
        deliverer.tick()
        time.sleep(0.01)


def deliveries(client: TestClient, run_id: str, auth: dict[str, str]) -> list[dict[str, Any]]:
    r = client.get(f"/v1/runs/{run_id}/webhooks", headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    data: list[dict[str, Any]] = body["data"]
    return data


@pytest.fixture
def run_with_hook(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    receiver: Receiver,
) -> tuple[str, dict[str, str]]:
    """A started run whose webhook asks for the terminal events."""
    hooks = [{"url": receiver.url, "events": TERMINAL}]
    return start_run(client, auth, tmp_path, settings, session_factory, hooks)


# -- the tests ------------------------------------------------------------------------------


class TestSignature:
    def test_a_delivery_is_signed_with_the_owners_secret_over_the_raw_body(
        self,
        client: TestClient,
        auth: dict[str, str],
        api_key: str,
        session_factory: sessionmaker[Session],
        run_with_hook: tuple[str, dict[str, str]],
        receiver: Receiver,
        deliverer: WebhookDeliverer,
    ) -> None:
        owner_secret = webhook_secret_of(session_factory, api_key)
        run_id, worker = run_with_hook
        succeed(client, run_id, worker)
        assert deliverer.tick() == 1

        [got] = receiver.received
        assert got.headers["content-type"] == "application/json"
        assert got.headers["user-agent"] == "tuneyard-webhooks"
        parts = dict(item.split("=", 1) for item in got.headers["tuneyard-signature"].split(","))
        timestamp = int(parts["t"])
        assert abs(time.time() - timestamp) < 60
        # What a receiver computes, from the raw body and its key's secret alone.
        expected = hmac.new(
            owner_secret.encode(), f"{timestamp}.".encode() + got.body, hashlib.sha256
        ).hexdigest()
        assert hmac.compare_digest(parts["v1"], expected)
        assert verify(owner_secret, got.headers["tuneyard-signature"], got.body)
        assert not verify(SECRET, got.headers["tuneyard-signature"], got.body)
        assert not verify(owner_secret, got.headers["tuneyard-signature"], got.body + b" ")

        payload = got.payload
        assert payload["id"] == got.key
        assert payload["type"] == "run.succeeded"
        assert payload["data"]["run"]["id"] == run_id
        assert payload["data"]["run"]["status"] == "succeeded"
        assert payload["data"]["run"]["finished_at"] is not None
        assert "webhooks" not in payload["data"]["run"]["spec"]

    def test_verify_refuses_an_old_or_malformed_signature(self) -> None:
        body = b'{"id":"whd_1"}'
        now = int(time.time())
        assert verify(SECRET, sign(SECRET, now, body), body)
        stale = sign(SECRET, now - 301, body)
        assert not verify(SECRET, stale, body)
        assert verify(SECRET, stale, body, tolerance_s=600)
        for header in ("", "t=abc,v1=00", f"t={now}", "v1=" + "0" * 64):
            assert not verify(SECRET, header, body)


class TestRetries:
    def test_a_receiver_failing_twice_gets_the_event_once_by_its_key(
        self,
        client: TestClient,
        auth: dict[str, str],
        api_key: str,
        session_factory: sessionmaker[Session],
        run_with_hook: tuple[str, dict[str, str]],
        receiver: Receiver,
        deliverer: WebhookDeliverer,
    ) -> None:
        receiver.script = [500, 500]
        run_id, worker = run_with_hook
        succeed(client, run_id, worker)

        assert deliverer.tick() == 1  # the first attempt; the retry is not due yet
        [pending] = deliveries(client, run_id, auth)
        assert (pending["status"], pending["attempts"]) == ("pending", 1)
        assert (pending["last_status_code"], pending["last_error"]) == (500, "HTTP 500")
        assert pending["next_attempt_at"] is not None

        deliver_until(deliverer, lambda: len(receiver.received) == 3)
        assert [r.answered for r in receiver.received] == [500, 500, 200]
        keys = {r.key for r in receiver.received}
        assert len(keys) == 1  # every attempt carried the same Idempotency-Key
        assert len({r.key for r in receiver.received if r.answered == 200}) == 1
        assert {r.body for r in receiver.received} == {receiver.received[0].body}
        owner_secret = webhook_secret_of(session_factory, api_key)
        assert all(
            verify(owner_secret, r.headers["tuneyard-signature"], r.body) for r in receiver.received
        )

        [done] = deliveries(client, run_id, auth)
        assert done["id"] in keys
        assert (done["status"], done["attempts"], done["event"]) == (
            "delivered",
            3,
            "run.succeeded",
        )
        assert (done["last_status_code"], done["last_error"]) == (200, None)
        assert done["delivered_at"] is not None and done["next_attempt_at"] is None
        assert done["url"] == receiver.url
        deliverer.tick()
        assert len(receiver.received) == 3  # delivered means never sent again

    def test_gives_up_after_the_last_attempt(
        self,
        client: TestClient,
        auth: dict[str, str],
        run_with_hook: tuple[str, dict[str, str]],
        receiver: Receiver,
        deliverer: WebhookDeliverer,
    ) -> None:
        receiver.script = [503] * 10
        run_id, worker = run_with_hook
        succeed(client, run_id, worker)
        deliver_until(deliverer, lambda: deliveries(client, run_id, auth)[0]["status"] != "pending")
        [failed] = deliveries(client, run_id, auth)
        assert (failed["status"], failed["attempts"]) == ("failed", 3)  # webhook_max_attempts
        assert (failed["last_status_code"], failed["last_error"]) == (503, "HTTP 503")
        assert len(receiver.received) == 3

    def test_an_unreachable_receiver_is_retried_with_the_class_of_failure(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        deliverer: WebhookDeliverer,
    ) -> None:
        hooks = [{"url": f"http://127.0.0.1:{free_port()}/gone"}]
        run_id, worker = start_run(client, auth, tmp_path, settings, session_factory, hooks)
        post_status(
            client,
            run_id,
            worker,
            "failed",
            error={"code": "training_error", "message": "boom"},
            check=True,
        )
        deliverer.tick()
        [pending] = deliveries(client, run_id, auth)
        assert (pending["status"], pending["attempts"]) == ("pending", 1)
        assert pending["last_status_code"] is None
        # The class only: the text (Connection refused) would make a port scanner of it.
        assert pending["last_error"] == "connection failed"

    def test_backoff_doubles_with_jitter_and_is_capped(self) -> None:
        for attempts, ceiling in ((1, 5), (2, 10), (3, 20), (20, 3600)):
            delays = [retry_delay_s(attempts, base_s=5) for _ in range(50)]
            assert all(ceiling / 2 <= d <= ceiling for d in delays), attempts
            assert len(set(delays)) > 1  # jittered


class TestQueue:
    def test_a_delivery_queued_before_a_restart_is_sent_after_it(
        self,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        receiver: Receiver,
    ) -> None:
        with TestClient(create_app(settings, start_background=False)) as first:
            hooks = [{"url": receiver.url}]
            run_id, worker = start_run(first, auth, tmp_path, settings, session_factory, hooks)
            succeed(first, run_id, worker)
        assert receiver.received == []  # the first service stopped before sending it

        second_app = create_app(settings, start_background=False)
        with TestClient(second_app) as second:
            restarted = WebhookDeliverer(
                settings=settings,
                session_factory=second_app.state.tuneyard.database.session_factory,
            )
            try:
                assert restarted.tick() == 1
            finally:
                restarted.stop()
            [done] = deliveries(second, run_id, auth)
        assert done["status"] == "delivered"
        assert receiver.events() == ["run.succeeded"]

    def test_a_rolled_back_transition_enqueues_nothing(
        self,
        run_with_hook: tuple[str, dict[str, str]],
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id, _ = run_with_hook

        def queued() -> list[str]:
            with session_factory() as session:
                return list(session.scalars(select(WebhookDelivery.event)))

        with session_factory() as session:
            run = session.get(Run, run_id)
            assert run is not None
            lifecycle.settle(
                session, run, RunStatus.FAILED, failure=Failure("x", "boom"), hooks=HOOKS
            )
            session.flush()
            assert session.scalars(select(WebhookDelivery.event)).all() == ["run.failed"]
            session.rollback()
        assert queued() == []

        with transaction(session_factory) as session:
            run = session.get(Run, run_id)
            assert run is not None
            lifecycle.settle(
                session, run, RunStatus.FAILED, failure=Failure("x", "boom"), hooks=HOOKS
            )
        assert queued() == ["run.failed"]

    def test_two_deliverers_on_one_database_send_each_delivery_once(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        receiver: Receiver,
    ) -> None:
        hooks = [{"url": receiver.url, "events": ["run.checkpoint"]}]
        run_id, worker = start_run(client, auth, tmp_path, settings, session_factory, hooks)
        for step in range(1, 13):
            path = run_location(settings, run_id, f"ckpt_{step}")
            body = {"attempt": 1, "step": step, "path": path, "kind": "deepspeed"}
            r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
            assert r.status_code == 200, r.text
        receiver.delay_s = 0.05  # sends overlap with the peer's claims

        # Two replicas: each its own engine (connection pool) on the same database.
        engines = [make_engine(settings.resolved_database_url) for _ in range(2)]
        peers = [
            WebhookDeliverer(settings=settings, session_factory=make_session_factory(e))
            for e in engines
        ]
        start = threading.Barrier(len(peers))
        sent: list[int] = []

        def run(peer: WebhookDeliverer) -> None:
            start.wait()
            sent.append(peer.tick())

        threads = [threading.Thread(target=run, args=(peer,)) for peer in peers]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
        finally:
            for peer in peers:
                peer.stop()
            for engine in engines:
                engine.dispose()

        keys = [r.key for r in receiver.received]
        assert len(keys) == 12 and len(set(keys)) == 12  # each delivery sent exactly once
        assert sum(sent) == 12 and 0 not in sent, sent  # both took part
        listed = deliveries(client, run_id, auth)
        assert {d["status"] for d in listed} == {"delivered"}
        assert sorted(r.payload["data"]["checkpoint"]["step"] for r in receiver.received) == list(
            range(1, 13)
        )

    def test_a_delivery_locked_by_a_peer_is_skipped_not_waited_for(
        self,
        run_with_hook: tuple[str, dict[str, str]],
        client: TestClient,
        settings: Settings,
        session_factory: sessionmaker[Session],
        deliverer: WebhookDeliverer,
        receiver: Receiver,
    ) -> None:
        """PostgreSQL's FOR UPDATE SKIP LOCKED: a peer's claim in flight holds its rows, and
        this deliverer takes the others at once. (SQLite has one writer at a time.)"""
        if settings.resolved_database_url.startswith("sqlite"):
            pytest.skip("SQLite serialises write transactions: there is no row lock to skip")
        run_id, worker = run_with_hook
        succeed(client, run_id, worker)
        with session_factory() as peer:
            locked = peer.scalars(select(WebhookDelivery).with_for_update()).one()
            started = time.monotonic()
            assert deliverer.claim_due(due_by=locked.next_attempt_at, limit=4) == []
            assert time.monotonic() - started < 5
            peer.rollback()
        assert deliverer.tick() == 1
        assert receiver.events() == ["run.succeeded"]


class TestEvents:
    def test_each_subscriber_gets_only_the_events_it_asked_for(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        receiver: Receiver,
        deliverer: WebhookDeliverer,
    ) -> None:
        hooks = [
            {"url": f"{receiver.url}/checkpoints", "events": ["run.checkpoint"]},
            {"url": f"{receiver.url}/failures", "events": ["run.failed"]},
            {"url": f"{receiver.url}/stops", "events": ["run.early_stopped", "run.succeeded"]},
        ]
        run_id, worker = start_run(client, auth, tmp_path, settings, session_factory, hooks)
        post_status(client, run_id, worker, "running", check=True)
        checkpoint = {
            "attempt": 1,
            "step": 4,
            "path": run_location(settings, run_id, "ckpt_4"),
            "kind": "deepspeed",
            "metrics": {"eval_loss": 1.5},
        }
        r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=checkpoint, headers=worker)
        assert r.status_code == 200, r.text
        stop = {"attempt": 1, "type": "early_stopped", "message": "eval_loss did not improve"}
        for _ in range(2):  # the repeat is a retried post: one event, one delivery
            r = client.post(f"/v1/internal/runs/{run_id}/events", json=stop, headers=worker)
            assert r.status_code == 200, r.text
        post_status(client, run_id, worker, "succeeded", check=True)

        listed = deliveries(client, run_id, auth)
        assert [(d["event"], d["url"].rsplit("/", 1)[1]) for d in listed] == [
            ("run.checkpoint", "checkpoints"),
            ("run.early_stopped", "stops"),
            ("run.succeeded", "stops"),
        ]
        deliver_until(deliverer, lambda: len(receiver.received) == 3)
        by_type = {r.payload["type"]: r.payload["data"] for r in receiver.received}
        assert by_type["run.checkpoint"]["checkpoint"]["step"] == 4
        assert by_type["run.checkpoint"]["checkpoint"]["path"] == checkpoint["path"]
        assert by_type["run.checkpoint"]["checkpoint"]["kind"] == "deepspeed"
        assert by_type["run.checkpoint"]["checkpoint"]["metrics"] == {"eval_loss": 1.5}
        assert by_type["run.early_stopped"]["message"] == "eval_loss did not improve"
        assert by_type["run.succeeded"]["run"]["status"] == "succeeded"

    def test_service_wide_subscribers_get_the_configured_events_of_every_run(
        self,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        receiver: Receiver,
    ) -> None:
        # On loopback, and allowed though no network is: the operator chose this receiver.
        service_wide = with_webhooks(
            settings,
            webhook_urls=[receiver.url],
            webhook_events=["run.failed"],
            webhook_allowed_networks="",
        )
        with TestClient(create_app(service_wide, start_background=False)) as client:
            ok_id, ok = start_run(client, auth, tmp_path, settings, session_factory, [])
            succeed(client, ok_id, ok)
            bad_id, bad = start_run(client, auth, tmp_path, settings, session_factory, [])
            post_status(
                client,
                bad_id,
                bad,
                "failed",
                error={"code": "training_error", "message": "boom"},
                check=True,
            )
            # The operator's subscriber is not the run owner's to see.
            assert deliveries(client, ok_id, auth) == deliveries(client, bad_id, auth) == []
        deliverer = WebhookDeliverer(settings=service_wide, session_factory=session_factory)
        try:
            assert deliverer.tick() == 1
        finally:
            deliverer.stop()
        [got] = receiver.received
        assert (got.payload["type"], got.payload["data"]["run"]["id"]) == ("run.failed", bad_id)
        # Signed with the service's secret, which its subscribers hold.
        assert verify(SECRET, got.headers["tuneyard-signature"], got.body)

    def test_a_cancelled_run_notifies_its_subscriber(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        receiver: Receiver,
    ) -> None:
        body = run_request(tmp_path, webhooks=[{"url": receiver.url}])
        run_id = client.post("/v1/runs", json=body, headers=auth).json()["id"]
        r = client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
        assert r.status_code == 200, r.text
        assert [d["event"] for d in deliveries(client, run_id, auth)] == ["run.cancelled"]


class TestBackgroundThread:
    def test_the_thread_delivers_without_being_asked(
        self,
        client: TestClient,
        auth: dict[str, str],
        run_with_hook: tuple[str, dict[str, str]],
        receiver: Receiver,
        deliverer: WebhookDeliverer,
    ) -> None:
        receiver.script = [500]
        deliverer.start()
        run_id, worker = run_with_hook
        succeed(client, run_id, worker)
        deadline = time.monotonic() + 10
        while deliveries(client, run_id, auth)[0]["status"] != "delivered":
            assert time.monotonic() < deadline, "the deliverer's thread sent nothing"
            time.sleep(0.02)
        assert [r.answered for r in receiver.received] == [500, 200]


class TestListRoute:
    def test_another_principals_run_is_not_found(
        self,
        client: TestClient,
        run_with_hook: tuple[str, dict[str, str]],
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id, _ = run_with_hook
        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        r = client.get(f"/v1/runs/{run_id}/webhooks", headers=other)
        assert r.status_code == 404
        assert client.get(f"/v1/runs/{run_id}/webhooks").status_code == 401

    def test_the_route_is_documented(self, client: TestClient) -> None:
        document = client.get("/openapi.json").json()
        operation = document["paths"]["/v1/runs/{run_id}/webhooks"]["get"]
        assert operation["operationId"] == "list_webhook_deliveries"
        schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/WebhookDeliveryList"}
        view = document["components"]["schemas"]["WebhookDeliveryView"]["properties"]
        assert {"id", "event", "url", "status", "attempts", "next_attempt_at"} <= set(view)


class TestBadInput:
    def test_a_webhook_url_that_is_not_http_is_refused(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        for url in ("ftp://example.com/hook", "file:///etc/passwd", "example.com/hook"):
            body = run_request(tmp_path, webhooks=[{"url": url}])
            r = client.post("/v1/runs", json=body, headers=auth)
            assert r.status_code == 422, url
            assert [p["field"] for p in r.json()["detail"]] == ["webhooks.0.url"]
            assert "http:// or https://" in r.json()["detail"][0]["message"]
        body = run_request(tmp_path, webhooks=[{"url": "https://example.com", "events": ["x"]}])
        assert client.post("/v1/runs", json=body, headers=auth).status_code == 422

    def test_webhooks_on_a_service_without_a_secret_are_refused(
        self, auth: dict[str, str], tmp_path: Path, settings: Settings
    ) -> None:
        unsigned = Settings(
            home=settings.home,
            database_url=settings.database_url,
            allowed_roots=settings.allowed_roots,
        )
        with TestClient(create_app(unsigned, start_background=False)) as client:
            body = run_request(tmp_path, webhooks=[{"url": "https://example.com/hook"}])
            r = client.post("/v1/runs", json=body, headers=auth)
            assert r.status_code == 422, r.text
            [problem] = r.json()["detail"]
            assert problem["field"] == "webhooks"
            assert "TUNEYARD_WEBHOOK_SECRET" in problem["message"]
            assert client.get("/v1/runs", headers=auth).json()["data"] == []  # nothing stored
            report = client.post("/v1/runs/validate", json=body, headers=auth).json()
            assert report["valid"] is False
            assert [p["field"] for p in report["errors"]] == ["webhooks"]
            # Without webhooks the same service takes the run.
            r = client.post("/v1/runs", json=run_request(tmp_path), headers=auth)
            assert r.status_code == 201, r.text

    def test_validate_accepts_webhooks_on_a_service_with_a_secret(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, webhooks=[{"url": "https://example.com/hook"}])
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is True, report["errors"]

    def test_service_wide_urls_without_a_secret_stop_the_start(self, tmp_path: Path) -> None:
        with pytest.raises(ValueError, match="TUNEYARD_WEBHOOK_URLS needs TUNEYARD_WEBHOOK_SECRET"):
            Settings(home=tmp_path, webhook_urls="https://example.com/hook")
        with pytest.raises(ValueError, match="at least 16 characters"):
            Settings(home=tmp_path, webhook_secret="short")
        with pytest.raises(ValueError, match="TUNEYARD_WEBHOOK_URLS must be"):
            Settings(home=tmp_path, webhook_secret=SECRET, webhook_urls="ftp://example.com")
        with pytest.raises(ValueError, match="TUNEYARD_WEBHOOK_EVENTS"):
            Settings(home=tmp_path, webhook_secret=SECRET, webhook_events="run.finished")
