"""Pooled PostgreSQL connections the server closed are replaced at checkout, without a ping
per checkout (app/db.py `_drop_closed_connections`), on a real PostgreSQL."""

from __future__ import annotations

import time

import psycopg
from sqlalchemy import event, text
from sqlalchemy.engine import make_url

from app.db import make_engine


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
