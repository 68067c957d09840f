"""OWASP API3 Broken Object Property Level Authorization, webhooks: a delivery shows its
receiver the run, and only the run; and only its own tenant can sign what its receiver
accepts.

Issue 39 found every payload carried the run's `spec.webhooks`, so each receiver saw the
other receivers' URLs and the tokens in them, and service-wide subscribers saw every
tenant's; and one secret signed every tenant's deliveries, so a tenant holding it could
forge a delivery to another tenant's receiver. These tests try: what a receiver and a
service-wide subscriber get; whose secret verifies a delivery (the owner key's, not
another key's, not the service's); the secret shown once by `tuneyard keys create` and
replaced by `tuneyard keys rotate-webhook-secret`; and what a tenant lists of the
operator's subscribers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from app.cli.commands import WEBHOOK_SECRET_LABEL, ExitCode
from app.cli.commands import app as cli
from app.main import create_app
from app.services.webhook_delivery import WebhookDeliverer
from app.services.webhooks import verify
from app.settings import Settings
from app.storage.models import ApiKey
from tests.app.test_webhooks import (
    SECRET,
    Receiver,
    deliver_until,
    deliveries,
    receiving,
    webhook_secret_of,
    with_webhooks,
)
from tests.conftest import make_api_key
from tests.factories import run_request

TOKEN_A, TOKEN_B, OPERATOR_TOKEN = "tok-a-" + "1" * 20, "tok-b-" + "2" * 20, "op-" + "3" * 20


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder


@pytest.fixture
def operator() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder


@pytest.fixture
def settings(settings: Settings, operator: Receiver) -> Settings:
    """A service whose operator subscribes to every run's terminal events."""
    return with_webhooks(settings, webhook_urls=[f"{operator.url}?token={OPERATOR_TOKEN}"])


def cancelled_run(
    client: TestClient, auth: dict[str, str], root: Path, hooks: list[dict[str, Any]]
) -> str:
    created = client.post("/v1/runs", json=run_request(root, webhooks=hooks), headers=auth)
    assert created.status_code == 201, created.text
    run_id: str = created.json()["id"]
    assert client.post(f"/v1/runs/{run_id}/cancel", headers=auth).status_code == 200
    return run_id


def deliver_all(settings: Settings, session_factory: sessionmaker[Session], count: int) -> None:
    deliverer = WebhookDeliverer(settings=settings, session_factory=session_factory)
    try:
        assert deliverer.tick() == count
    finally:
        deliverer.stop()


def test_a_payload_names_no_webhook(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    receiver: Receiver,
    operator: Receiver,
) -> None:
    hooks = [
        {"url": f"{receiver.url}/one?token={TOKEN_A}"},
        {"url": f"{receiver.url}/two?token={TOKEN_B}"},
    ]
    run_id = cancelled_run(client, auth, tmp_path, hooks)
    deliver_all(settings, session_factory, 3)

    assert len(receiver.received) == 2 and len(operator.received) == 1
    for got in [*receiver.received, *operator.received]:
        assert got.payload["data"]["run"]["id"] == run_id
        assert "webhooks" not in got.payload["data"]["run"]["spec"]
        for secret in (TOKEN_A, TOKEN_B, OPERATOR_TOKEN, receiver.url):
            assert secret.encode() not in got.body
    # The owner still reads its own run's webhooks.
    spec = client.get(f"/v1/runs/{run_id}", headers=auth).json()["spec"]
    assert [h["url"] for h in spec["webhooks"]] == [h["url"] for h in hooks]


def test_each_key_signs_its_own_runs_deliveries(
    client: TestClient,
    auth: dict[str, str],
    api_key: str,
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    receiver: Receiver,
    operator: Receiver,
) -> None:
    key_b = make_api_key(session_factory, "team-b")
    auth_b = {"Authorization": f"Bearer {key_b}"}
    secret_a = webhook_secret_of(session_factory, api_key)
    secret_b = webhook_secret_of(session_factory, key_b)
    assert len({secret_a, secret_b, SECRET}) == 3

    run_a = cancelled_run(client, auth, tmp_path, [{"url": f"{receiver.url}/a"}])
    run_b = cancelled_run(client, auth_b, tmp_path, [{"url": f"{receiver.url}/b"}])
    deliver_all(settings, session_factory, 4)

    signed = {
        got.payload["data"]["run"]["id"]: (got.headers["tuneyard-signature"], got.body)
        for got in receiver.received
    }
    for run_id, own, others in ((run_a, secret_a, secret_b), (run_b, secret_b, secret_a)):
        header, body = signed[run_id]
        assert verify(own, header, body)
        assert not verify(others, header, body)  # no tenant can sign for another
        assert not verify(SECRET, header, body)
    # The service's subscriber holds the service's secret, which signs what it gets.
    assert len(operator.received) == 2
    for got in operator.received:
        assert verify(SECRET, got.headers["tuneyard-signature"], got.body)
        assert not verify(secret_a, got.headers["tuneyard-signature"], got.body)


def test_a_tenant_lists_its_own_hooks_deliveries_not_the_operators(
    client: TestClient, auth: dict[str, str], tmp_path: Path, receiver: Receiver
) -> None:
    run_id = cancelled_run(client, auth, tmp_path, [{"url": receiver.url}])
    listed = deliveries(client, run_id, auth)
    assert [d["url"] for d in listed] == [receiver.url]
    assert OPERATOR_TOKEN not in json.dumps(listed)


class TestKeysCommands:
    def keys(self, settings: Settings, *args: str) -> Any:
        env = {"TUNEYARD_DATABASE_URL": settings.resolved_database_url, "COLUMNS": "200"}
        return CliRunner().invoke(cli, ["keys", *args], env=env, catch_exceptions=False)

    def stored_secret(self, session_factory: sessionmaker[Session], name: str) -> str | None:
        with session_factory() as session:
            return session.scalars(select(ApiKey.webhook_secret).where(ApiKey.name == name)).one()

    def test_the_secret_is_shown_once_and_rotated(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
        receiver: Receiver,
    ) -> None:
        created = self.keys(settings, "create", "--name", "ci")
        assert created.exit_code == ExitCode.OK, created.stderr
        # stdout is the API key alone, as scripts read it; the signing secret, labelled, on
        # stderr.
        [api_key] = created.stdout.split()
        assert api_key.startswith("ty_")
        [line] = [line for line in created.stderr.splitlines() if WEBHOOK_SECRET_LABEL in line]
        shown = line.split(WEBHOOK_SECRET_LABEL, 1)[1].strip()
        assert shown.startswith("whsec_")
        assert shown == self.stored_secret(session_factory, "ci")
        assert shown not in self.keys(settings, "list", "--json").stdout

        rotated = self.keys(settings, "rotate-webhook-secret", "ci")
        assert rotated.exit_code == ExitCode.OK, rotated.stderr
        [new] = rotated.stdout.split()
        assert new != shown and new == self.stored_secret(session_factory, "ci")

        # A delivery sent from now on is signed with the new secret.
        auth = {"Authorization": f"Bearer {api_key}"}
        with TestClient(create_app(settings, start_background=False)) as client:
            cancelled_run(client, auth, tmp_path, [{"url": receiver.url}])
        deliverer = WebhookDeliverer(settings=settings, session_factory=session_factory)
        try:
            deliver_until(deliverer, lambda: len(receiver.received) == 1)
        finally:
            deliverer.stop()
        [got] = receiver.received
        assert verify(new, got.headers["tuneyard-signature"], got.body)
        assert not verify(shown, got.headers["tuneyard-signature"], got.body)

        unknown = self.keys(settings, "rotate-webhook-secret", "nobody")
        assert unknown.exit_code == ExitCode.NOT_FOUND
