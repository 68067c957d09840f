"""Pooled PostgreSQL connections the server closed are replaced at checkout, without a ping
per checkout (app/storage/db.py `_drop_closed_connections`), on a real PostgreSQL."""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import make_url

from app.storage import db
from app.storage.db import make_engine


def _terminate(url: str, pid: int) -> None:
    """As an operator's pg_terminate_backend or a server restart would; waits until it is gone."""
    plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(plain, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the backend did not exit"
            time.sleep(0.05)


def test_a_connection_the_server_closed_is_replaced_and_none_is_pinged(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    statements: list[str] = []
    event.listen(
        engine, "before_cursor_execute", lambda *args: statements.append(str(args[2]).lower())
    )
    pings: list[object] = []
    ping = engine.dialect.do_ping
    engine.dialect.do_ping = lambda dbapi_connection: (
        pings.append(dbapi_connection)
        or ping(  # type: ignore[method-assign]
            dbapi_connection
        )
    )
    try:
        with engine.connect() as connection:
            old = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        _terminate(postgres_url, old)

        # The pooled connection is dead: the checkout sees it and takes a new one, so the
        # statement runs, on another backend.
        with engine.connect() as connection:
            new = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        assert new != old
        # Checked out again while alive: the same backend, and no statement but ours (no
        # pre-ping's SELECT 1 on either checkout).
        with engine.connect() as connection:
            again = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        assert again == new
        assert statements == ["select pg_backend_pid()"] * 3
        assert pings == []
    finally:
        engine.dispose()


def test_a_connection_idle_for_long_is_pinged_first(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection a firewall forgot shows nothing on its socket: past IDLE_PING_S idle,
    the checkout asks the server, as the pre-ping did on every checkout."""
    engine = make_engine(postgres_url)
    pings = _count_pings(engine)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        monkeypatch.setattr(db, "IDLE_PING_S", 0.0)
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        assert len(pings) == 1
    finally:
        engine.dispose()


def test_connections_past_1024_open_files_are_checked_too(postgres_url: str) -> None:
    """select() refuses descriptors from 1024 on, and a busy service has that many."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"the open-file limit here is {soft}")
    engine = make_engine(postgres_url)
    held = [open(os.devnull) for _ in range(1100)]  # noqa: SIM115
    try:
        for _ in range(2):
            with engine.connect() as connection:
                assert connection.execute(text("SELECT 1")).scalar_one() == 1
                fd = connection.connection.dbapi_connection.pgconn.socket  # type: ignore[union-attr]
        assert fd >= 1024
    finally:
        for f in held:
            f.close()
        engine.dispose()


def _count_pings(engine: Any) -> list[object]:
    pings: list[object] = []
    ping = engine.dialect.do_ping

    def counted(dbapi_connection: object) -> bool:
        pings.append(dbapi_connection)
        return bool(ping(dbapi_connection))

    engine.dialect.do_ping = counted
    return pings
