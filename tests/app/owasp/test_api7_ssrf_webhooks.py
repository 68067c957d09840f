"""OWASP API7 Server Side Request Forgery, webhooks: a tenant names the URL, the service POSTs
to it from inside its network and shows the tenant how that went.

Issue 39 found nothing checked the destination: 127.0.0.1, localhost, 0x7f000001 and
[::ffff:127.0.0.1] were all delivered, the service's own /v1/internal routes answered, and
a closed port read back as `ConnectError … Connection refused` in GET /v1/runs/{id}/webhooks:
a port scanner of the Ray dashboard, PostgreSQL or a cloud metadata service. And
`user:password@` in the URL became a tenant-chosen Authorization header. These tests try
every form of an internal address and credentials when the run is made; a name that
resolves outside when the run is made and to loopback when the delivery is sent (DNS is the
only fake here: the receivers are real servers on loopback); a pinned connection over TLS,
which must still check the certificate against the name; the operator's allow-list; and
what a failed delivery tells the tenant."""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.ports import free_port
from app.services.rules import webhook_addresses
from app.services.rules.webhook_addresses import IPAddress
from app.services.webhook_delivery import WebhookDeliverer
from app.settings import Settings
from app.storage.models import Run, WebhookDelivery
from tests.app.test_webhooks import Receiver, deliveries, receiving, with_webhooks
from tests.factories import run_request

PUBLIC = "93.184.215.14"
# Every form an address webhooks may not reach takes in a URL (the names through DNS).
FORBIDDEN = [
    "http://127.0.0.1:8265/api/jobs/",  # the Ray dashboard
    "http://localhost:5432/",
    "http://app.localhost/",
    "http://0x7f000001/",
    "http://2130706433/",
    "http://127.1/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://10.0.0.5/",
    "http://172.16.3.4/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://[fd00::1]/",
    "http://[fe80::1]/",
    "http://[fec0::1]/",  # site-local: deprecated, and global to Python's ipaddress
    "http://224.0.0.1/",
    "http://[ff02::1]/",
    "http://0.0.0.0/",
    "http://[::]/",
    "http://240.0.0.1/",
    "http://[2002:7f00:1::]/",  # 6to4, carrying 127.0.0.1
    "http://[64:ff9b::a00:5]/",  # NAT64, carrying 10.0.0.5
    "http://db.internal.test:5432/",  # a name, resolving to a private address
    "http://mixed.example.test/",  # a name with a public and a loopback address
]


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The names DNS knows (name -> addresses), for the rule's every lookup; any other name
    does not resolve."""
    names: dict[str, list[str]] = {
        "db.internal.test": ["10.1.2.3"],
        "mixed.example.test": [PUBLIC, "127.0.0.1"],
    }

    def resolve(host: str, port: int) -> list[IPAddress]:
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(address) for address in names[host]]

    monkeypatch.setattr(webhook_addresses, "resolve", resolve)
    return names


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Webhooks signed, and no private network allowed: the service's defaults."""
    return with_webhooks(settings, webhook_allowed_networks="")


def _stored(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Run)) or 0


def _refusal(client: TestClient, auth: dict[str, str], root: Path, url: str) -> str:
    """The message of the one problem a run with a webhook at `url` gets, created and
    validated alike."""
    body = run_request(root, webhooks=[{"url": "https://hooks.example.test/ok"}, {"url": url}])
    created = client.post("/v1/runs", json=body, headers=auth)
    assert created.status_code == 422, (url, created.text)
    validated = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert validated["valid"] is False, url
    for problems in (created.json()["detail"], validated["errors"]):
        assert [p["field"] for p in problems] == ["webhooks.1.url"], (url, problems)
    message: str = created.json()["detail"][0]["message"]
    return message


def test_every_form_of_an_internal_address_is_refused_when_the_run_is_made(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    dns: dict[str, list[str]],
) -> None:
    dns["hooks.example.test"] = [PUBLIC]
    for url in FORBIDDEN:
        message = _refusal(client, auth, tmp_path, url)
        assert "public addresses only" in message, (url, message)
        assert "TUNEYARD_WEBHOOK_ALLOWED_NETWORKS" in message
    # What a name resolves to is not told: that would map the internal network.
    assert "10.1.2.3" not in _refusal(client, auth, tmp_path, "http://db.internal.test/")
    assert _stored(session_factory) == 0

    # A public name is taken; so is one that does not resolve now (the deliverer checks
    # every connection, which is the guard).
    # An internationalised name too, as httpx writes it on the wire (punycode) or not.
    for url in (
        "https://hooks.example.test/a",
        "https://not-yet.example.test/b",
        "https://münchen.example.test/c",
        "https://xn--mnchen-3ya.example.test/d",
    ):
        body = run_request(tmp_path, webhooks=[{"url": url}])
        assert client.post("/v1/runs", json=body, headers=auth).status_code == 201, url


def test_credentials_in_a_url_are_refused_without_being_shown(
    client: TestClient, auth: dict[str, str], tmp_path: Path, dns: dict[str, list[str]]
) -> None:
    dns["hooks.example.test"] = [PUBLIC]
    for url in (
        "https://ci:hunter2-password@hooks.example.test/hook",
        "https://hunter2-password@hooks.example.test/hook",
    ):
        message = _refusal(client, auth, tmp_path, url)
        assert "credentials" in message and "hunter2" not in message


def test_the_allow_list_admits_private_receivers_but_never_metadata(
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    dns: dict[str, list[str]],
) -> None:
    allowing = with_webhooks(
        settings,
        webhook_allowed_networks="10.1.0.0/16, 169.254.0.0/16, fd12::/16, ci.corp.test",
    )
    dns.update({"ci.corp.test": ["10.9.9.9"], "hooks.example.test": [PUBLIC]})
    with TestClient(create_app(allowing, start_background=False)) as client:
        for url in (
            "http://10.1.2.3/hook",
            "http://db.internal.test/hook",  # resolves to 10.1.2.3
            "http://[fd12::5]/hook",
            "http://ci.corp.test/hook",  # a listed name, wherever it resolves
            "http://169.254.10.10/hook",
        ):
            body = run_request(tmp_path, webhooks=[{"url": url}])
            created = client.post("/v1/runs", json=body, headers=auth)
            assert created.status_code == 201, (url, created.text)
        for url in (
            "http://10.2.0.1/hook",
            "http://127.0.0.1/hook",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::ffff:169.254.169.254]/",
        ):
            _refusal(client, auth, tmp_path, url)


def test_the_allow_list_setting_is_checked_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TUNEYARD_WEBHOOK_ALLOWED_NETWORKS"):
        Settings(home=tmp_path, webhook_allowed_networks="10.0.0.0/33")
    with pytest.raises(ValueError, match="TUNEYARD_WEBHOOK_ALLOWED_NETWORKS"):
        Settings(home=tmp_path, webhook_allowed_networks="not a host!")


@pytest.mark.parametrize(
    "inside",
    ["127.0.0.1", "10.1.2.3", "169.254.169.254", "fd00::1"],
    ids=["loopback", "private", "metadata", "unique-local-v6"],
)
def test_a_name_that_turns_inside_is_refused_when_the_delivery_connects(
    inside: str,
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    settings: Settings,
    dns: dict[str, list[str]],
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DNS rebinding: public while the run is checked, inside once the delivery is sent
    (on loopback a real receiver listens)."""
    dns["rebind.example.test"] = [PUBLIC]
    port = receiver.url.split(":")[2].split("/")[0]
    body = run_request(tmp_path, webhooks=[{"url": f"http://rebind.example.test:{port}/hooks"}])
    created = client.post("/v1/runs", json=body, headers=auth)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    client.post(f"/v1/runs/{run_id}/cancel", headers=auth)

    dns["rebind.example.test"] = [inside]
    with monkeypatch.context() as env:
        # A proxy would resolve the name itself, past the rule: none is used.
        env.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
        assert _tick_once(settings, session_factory) == 1
    assert receiver.received == []
    [refused] = deliveries(client, run_id, auth)
    assert (refused["status"], refused["attempts"], refused["last_status_code"]) == (
        "pending",
        1,
        None,
    )
    assert refused["last_error"] == "refused: address not allowed"


def test_a_delivery_connects_to_the_address_it_checked_keeping_the_name(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    settings: Settings,
    dns: dict[str, list[str]],
) -> None:
    """Over TLS to a name only the substituted DNS knows: the connection goes to the
    address the rule checked, and TLS sends the name (SNI) and checks the certificate
    against it; a certificate for another name is refused."""
    server_tls, client_tls, names_seen = _tls_for("hooks.example.test", tmp_path)
    allowing = with_webhooks(settings, webhook_allowed_networks="127.0.0.0/8")
    dns.update({"hooks.example.test": ["127.0.0.1"], "other.example.test": ["127.0.0.1"]})
    with receiving(tls=server_tls) as receiver:
        port = receiver.url.split(":")[2].split("/")[0]
        hooks = [
            {"url": f"https://hooks.example.test:{port}/hooks"},
            {"url": f"https://other.example.test:{port}/hooks"},
        ]
        run_id = _cancelled_run(allowing, auth, tmp_path, hooks)
        deliverer = WebhookDeliverer(
            settings=allowing, session_factory=session_factory, verify=client_tls
        )
        try:
            assert deliverer.tick() == 2
        finally:
            deliverer.stop()
        [got] = receiver.received
        assert got.headers["host"] == f"hooks.example.test:{port}"
    assert "hooks.example.test" in names_seen
    listed = {d["url"].split("//")[1].split(":")[0]: d for d in deliveries(client, run_id, auth)}
    assert listed["hooks.example.test"]["status"] == "delivered"
    assert listed["other.example.test"]["last_error"] == "connection failed"


def test_the_connection_goes_to_the_address_checked_not_to_a_second_answer(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    settings: Settings,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pinned: the delivery looks the name up once, checks that answer and connects to it.
    A resolver that answers the receiver's address once and the metadata address after
    that (a rebinding DNS server with a zero TTL) gets the delivery to the receiver, so no
    second lookup chose where the socket went."""
    allowing = with_webhooks(settings, webhook_allowed_networks="127.0.0.0/8")
    port = receiver.url.split(":")[2].split("/")[0]
    url = f"http://pinned.example.test:{port}/hooks"
    answers = {"pinned.example.test": [PUBLIC]}  # while the run is checked

    def resolve(host: str, port: int) -> list[IPAddress]:
        lookups.append(host)
        return [ipaddress.ip_address(a) for a in answers[host]]

    lookups: list[str] = []
    monkeypatch.setattr(webhook_addresses, "resolve", resolve)
    run_id = _cancelled_run(allowing, auth, tmp_path, [{"url": url}])

    def rebinding(host: str, port: int) -> list[IPAddress]:
        lookups.append(host)
        answer = "127.0.0.1" if len(lookups) == 1 else "169.254.169.254"
        return [ipaddress.ip_address(answer)]

    lookups.clear()
    monkeypatch.setattr(webhook_addresses, "resolve", rebinding)
    assert _tick_once(allowing, session_factory) == 1
    assert lookups == ["pinned.example.test"]
    assert len(receiver.received) == 1
    [delivered] = deliveries(client, run_id, auth)
    assert (delivered["status"], delivered["last_error"]) == ("delivered", None)


def test_credentials_in_a_url_stored_before_the_rule_are_not_sent(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    settings: Settings,
    receiver: Receiver,
) -> None:
    """A delivery whose URL carries `user:password@` (a run stored before the rule, whose
    stored URL is not checked again) is refused at send time: httpx would turn it into a
    tenant-chosen `Authorization: Basic` header."""
    allowing = with_webhooks(settings, webhook_allowed_networks="127.0.0.1")
    run_id = _cancelled_run(allowing, auth, tmp_path, [{"url": receiver.url}])
    with session_factory.begin() as session:
        [row] = session.scalars(select(WebhookDelivery)).all()
        row.url = receiver.url.replace("http://", "http://admin:hunter2@")
    assert _tick_once(allowing, session_factory) == 1
    assert receiver.received == []
    [refused] = deliveries(client, run_id, auth)
    assert (refused["status"], refused["last_error"]) == ("pending", "refused: URL not allowed")


def test_a_failed_delivery_records_only_the_class_of_failure(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    settings: Settings,
    receiver: Receiver,
) -> None:
    """A closed port, a receiver that does not answer in time and one that answers 503:
    nothing of an exception's text (`Connection refused`, errno) reaches the tenant."""
    allowing = with_webhooks(settings, webhook_allowed_networks="127.0.0.1", webhook_timeout_s=0.5)
    receiver.delay_s = 1.5
    closed = f"http://127.0.0.1:{free_port()}/closed"
    run_id = _cancelled_run(allowing, auth, tmp_path, [{"url": closed}, {"url": receiver.url}])
    _tick_once(allowing, session_factory)
    errors = {d["url"]: d["last_error"] for d in deliveries(client, run_id, auth)}
    assert errors == {closed: "connection failed", receiver.url: "timed out"}


def _cancelled_run(
    settings: Settings, auth: dict[str, str], root: Path, hooks: list[dict[str, str]]
) -> str:
    """A run with `hooks`, made on a service with `settings` and cancelled at once: its
    `run.cancelled` deliveries are due."""
    with TestClient(create_app(settings, start_background=False)) as app_client:
        body = run_request(root, webhooks=hooks)
        created = app_client.post("/v1/runs", json=body, headers=auth)
        assert created.status_code == 201, created.text
        run_id: str = created.json()["id"]
        app_client.post(f"/v1/runs/{run_id}/cancel", headers=auth)
    return run_id


def _tick_once(settings: Settings, session_factory: sessionmaker[Session]) -> int:
    """One pass of a deliverer with `settings`: how many deliveries it sent or tried."""
    deliverer = WebhookDeliverer(settings=settings, session_factory=session_factory)
    try:
        return deliverer.tick()
    finally:
        deliverer.stop()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder


def _tls_for(name: str, folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext, list[str]]:
    """A server context with a certificate for `name` from a CA of the test's own, a client
    context that trusts only that CA, and the server names clients asked for (SNI)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.now(UTC)

    def certificate(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: object, ca: bool
    ) -> x509.Certificate:
        subject_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject_name)
            .issuer_name(issuer if not ca else subject_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
            )
        assert isinstance(signer, ec.EllipticCurvePrivateKey)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("tuneyard test CA", ca_key, x509.Name([]), ca_key, True)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = certificate(name, leaf_key, ca.subject, ca_key, False)
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "leaf.key").write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    names_seen: list[str] = []
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "leaf.pem", folder / "leaf.key")
    server.sni_callback = lambda _socket, server_name, _context: names_seen.append(
        server_name or ""
    )
    client = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    return server, client, names_seen
