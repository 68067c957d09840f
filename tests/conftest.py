"""Shared fixtures: a real database per test (SQLite file and PostgreSQL), the app, keys."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from xdist.remote import Producer

from app.main import create_app
from app.ports import free_port
from app.services.api_keys import create_api_key
from app.settings import Settings
from app.storage.db import make_engine, make_session_factory, transaction
from app.storage.migrate import upgrade_database
from app.storage.models import Base
from contract.job_env import path_with_this_environment
from tests import postgres_server
from tests.e2e.lanes import LANES, LaneScheduling

# The processes pytest-xdist starts have found COLUMNS=80 in their environment here (from
# nothing in xdist, execnet or pytest that we could find), and the CLI's consoles, made when
# app.cli.commands is imported, would keep that width for good. The CLI tests give each
# command the COLUMNS it should see, as a user's shell does.
os.environ.pop("COLUMNS", None)


def create_postgres_database(admin_url: str | None = None) -> str:
    """A fresh, empty database in the tests' server (tests/postgres_server.py); its URL."""
    admin_url = admin_url or postgres_server.admin_url()
    name = f"tuneyard_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(url: str, admin_url: str | None = None) -> None:
    name = make_url(url).database
    admin = create_engine(admin_url or postgres_server.admin_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _selected_halves(config: pytest.Config) -> tuple[bool, bool]:
    """Whether this session runs any e2e test, and any other test, by the paths it was
    given (pyproject's testpaths when none) less those it ignores."""
    root = Path(config.rootpath)
    e2e = (root / "tests" / "e2e").resolve()
    ignored = {(root / p).resolve() for p in config.getoption("ignore") or []}
    paths = [(root / a.split("::")[0]).resolve() for a in config.args] or [root / "tests"]
    with_e2e = e2e not in ignored and any(
        p == e2e or p.is_relative_to(e2e) or e2e.is_relative_to(p) for p in paths
    )
    with_rest = any(not (p == e2e or p.is_relative_to(e2e)) for p in paths)
    return with_e2e, with_rest


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): a process per e2e lane, whose time goes mostly to
    its Ray cluster's own processes, and one per core for everything else; both where a
    session runs both halves. PYTEST_XDIST_AUTO_NUM_WORKERS still decides when it is set,
    as it does in xdist's own."""
    if (chosen := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "")).isdigit():
        return int(chosen)
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    with_e2e, with_rest = _selected_halves(config)
    if not with_e2e:
        return cores
    if not with_rest:
        return len(LANES)
    return len(LANES) + max(1, cores - len(LANES))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LaneScheduling:
    """Each e2e lane on one process, every other test wherever there is room."""
    return LaneScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def venv_tools_on_path() -> Iterator[None]:
    """This environment's bin folder first on PATH for everything the tests start, as the
    embedded Ray head gives its jobs (contract/job_env.py says why)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", path_with_this_environment(os.environ.get("PATH")))
        yield


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """One migrated PostgreSQL database for the session; tests empty it between them."""
    admin_url = postgres_server.admin_url()
    if not postgres_server.answers(admin_url):
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {admin_url}")
        pytest.skip(f"PostgreSQL is not reachable at {admin_url}")
    url = create_postgres_database()
    upgrade_database(url)
    yield url
    drop_postgres_database(url)


@pytest.fixture(scope="session")
def sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to the newest revision once per session: each test starts from
    a copy of it rather than running every migration again (a third of a second a test).
    tests/app/storage/test_migrations.py migrates empty databases itself."""
    path = tmp_path_factory.mktemp("sqlite-at-head") / "tuneyard.db"
    upgrade_database(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_at_head: Path) -> str:
    """A SQLite file of the test's own, at the newest revision and empty."""
    path = tmp_path / "tuneyard.db"
    shutil.copyfile(sqlite_at_head, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every data-layer and API test runs on a real SQLite file and a real PostgreSQL, each
    at the newest revision and empty. (A module that needs only one overrides this with
    `sqlite_url`.)"""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_url")
        return
    url: str = request.getfixturevalue("postgres_url")
    yield url
    engine = create_engine(url)
    with engine.begin() as conn:
        names = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {names} CASCADE"))
    engine.dispose()


@pytest.fixture
def settings(tmp_path: Path, database_url: str, tiny_model_dir: Path) -> Settings:
    home = tmp_path / "home"
    home.mkdir()
    return Settings(
        home=home, database_url=database_url, allowed_roots=f"{tmp_path}:{tiny_model_dir}"
    )


@pytest.fixture
def session_factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    # `database_url` is at the newest revision already.
    engine = make_engine(settings.resolved_database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """The HTTP layer on a real database, without Ray or the dispatcher."""
    with TestClient(create_app(settings, start_background=False)) as test_client:
        yield test_client


def make_api_key(session_factory: sessionmaker[Session], name: str = "team-a") -> str:
    with transaction(session_factory) as session:
        _, secret = create_api_key(session, name=name)
    return secret


@pytest.fixture
def api_key(client: TestClient, session_factory: sessionmaker[Session]) -> str:
    return make_api_key(session_factory)


@pytest.fixture
def auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every tiny model, so a service can allow it as a root."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models_root: Path) -> Path:
    """A tiny GPT-2 and tokenizer, built once per test session."""
    from app.cli.tiny_assets import build_tiny_gpt2

    return build_tiny_gpt2(tiny_models_root / "gpt2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models_root: Path) -> Path:
    from app.cli.tiny_assets import build_tiny_llama

    return build_tiny_llama(tiny_models_root / "llama")


@pytest.fixture(scope="session")
def tiny_bert_dir(tiny_models_root: Path) -> Path:
    from app.cli.tiny_assets import build_tiny_bert

    return build_tiny_bert(tiny_models_root / "bert")


@dataclass
class S3Server:
    """moto's S3-compatible server on a loopback port: a real HTTP S3 endpoint that
    pyarrow, Ray Train and boto3 talk to as they would to AWS or MinIO."""

    endpoint: str
    env: dict[str, str]

    def create_bucket(self) -> str:
        import boto3

        name = f"tuneyard-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials()).create_bucket(
            Bucket=name
        )
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials())
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


_S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tuneyard-test",
    "AWS_SECRET_ACCESS_KEY": "tuneyard-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": _S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": _S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": _S3_CREDENTIALS["AWS_DEFAULT_REGION"],
    }


@contextmanager
def running_s3_server(log: Path) -> Iterator[S3Server]:
    """moto's server on a free loopback port while the block runs."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("moto_server")),
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            httpx.get(endpoint, timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield S3Server(endpoint, {**_S3_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running_s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """This process's AWS variables pointed at the test S3 server."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
