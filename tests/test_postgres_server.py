"""The throwaway PostgreSQL server a machine without one gets (tests/postgres_server.py):
started from the wheel, it takes the migrations and the suite's database lifecycle, as the
machine's own server does. Here the machine has a server, so this starts a second one."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect

from app.ports import free_port
from app.storage.migrate import upgrade_database
from tests import postgres_server
from tests.conftest import create_postgres_database, drop_postgres_database


def test_a_throwaway_server_takes_the_migrations() -> None:
    admin_url = postgres_server.start_throwaway_server()
    if admin_url is None:
        pytest.skip("the pgserver wheel is not installed")
    assert admin_url != postgres_server.MACHINE_URL
    assert postgres_server.answers(admin_url)

    url = create_postgres_database(admin_url)
    upgrade_database(url)
    engine = create_engine(url)
    try:
        assert {"runs", "events", "metrics", "api_keys"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    drop_postgres_database(url, admin_url)
    assert not postgres_server.answers(url)


def test_with_no_server_on_the_machine_the_suite_starts_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("pgserver")
    monkeypatch.delenv(postgres_server.URL_ENV, raising=False)
    nobody = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres"
    monkeypatch.setattr(postgres_server, "MACHINE_URL", nobody)
    postgres_server.admin_url.cache_clear()
    try:
        url = postgres_server.admin_url()
        assert url != nobody and "host=" in url
        assert postgres_server.answers(url)
    finally:
        postgres_server.admin_url.cache_clear()
