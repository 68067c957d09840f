"""Engine and session factory; SQLite is tuned for a service with concurrent writers."""

from __future__ import annotations

import select
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")

# Writers wait this long for SQLite's lock instead of failing with "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Connections, per engine and process. Every connection a request uses is taken under an
# admission slot (app/api/deps.py) that is awaited on the event loop, and the pool holds a
# connection for every slot at once, plus the work that is not admitted: admitted work
# therefore never waits for a connection, and nothing that waits can hold the connection
# another waiter needs. With 2 processes on one PostgreSQL this stays well under its default
# of 100 connections.
#   request sessions (`SessionDep`, `run_in_read_session`) admitted at once. More is slower:
#   each admitted session's thread hands the GIL back and forth with the others and the
#   loop, and under 200 clients on PostgreSQL 24 slots gave a p99 of 1.6-2.2 s against
#   1.2-1.3 s with 12, and fewer requests answered (BENCHMARKS.md, load).
REQUEST_SESSION_SLOTS = 12
#   API-key lookups: slots of their own, as one runs while its request's session is admitted
KEY_LOOKUP_SLOTS = 4
#   work outside requests: the dispatcher and reconciler (one thread), a /metrics scrape
BACKGROUND_CONNECTIONS = 4
# Beyond those, for work nobody counts (an event stream's polls): it holds a connection only
# while it reads, so whoever waits for it waits briefly, never for good.
POOL_MAX_OVERFLOW = 8
# How long a checkout waits before failing; with the sizes above, only uncounted work waits.
POOL_TIMEOUT_S = 30.0
# A PostgreSQL connection idle this long is pinged at checkout (see _drop_closed_connections).
IDLE_PING_S = 10.0


def pool_size() -> int:
    return REQUEST_SESSION_SLOTS + KEY_LOOKUP_SLOTS + BACKGROUND_CONNECTIONS


def _pool_options() -> dict[str, Any]:
    return {
        "pool_size": pool_size(),
        "max_overflow": POOL_MAX_OVERFLOW,
        "pool_timeout": POOL_TIMEOUT_S,
    }


def make_engine(url: str, *, for_writes: bool = True) -> Engine:
    """`for_writes=False` gives a SQLite engine whose transactions begin deferred: readers
    then share the database in WAL mode instead of queueing for the write lock."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        psycopg3 = parsed.get_driver_name() == "psycopg"
        engine = create_engine(url, pool_pre_ping=not psycopg3, **_pool_options())
        if psycopg3:
            _drop_closed_connections(engine)
        return engine

    on_disk = bool(parsed.database) and parsed.database != ":memory:"
    if on_disk:
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        # In-memory SQLite lives in one connection (SingletonThreadPool), which takes no size.
        **(_pool_options() if on_disk else {}),
    )

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        # Hand transaction control to the "begin" listener below, not pysqlite's own.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: Any) -> None:
        # A deferred transaction that reads and then writes fails at once ("database is
        # locked") if another writer committed meanwhile; IMMEDIATE waits its turn instead.
        # Straight to the driver: this runs once per transaction, and SQLAlchemy's own
        # statement execution would cost more than the statement.
        conn.connection.driver_connection.execute("BEGIN IMMEDIATE" if for_writes else "BEGIN")

    return engine


def _drop_closed_connections(engine: Engine) -> None:
    """A pooled connection the server has closed (a restart, an idle timeout, an operator's
    pg_terminate_backend) is replaced at checkout, so no request fails on it.

    SQLAlchemy's `pool_pre_ping` would ask the server on every checkout: a round trip, and a
    wait for the GIL on the way back, an eighth of the service's CPU under load (BENCHMARKS.md).
    Instead: a server that closes a connection says so on its socket (a FATAL notice, then
    EOF), while an idle connection of tuneyard's gets nothing unasked (it LISTENs to
    nothing), so one whose socket has something to read is dropped without a round trip (the
    rare harmless notice costs a reconnect). A connection that a firewall or NAT forgot on
    the way shows nothing until it is used: one idle for over IDLE_PING_S is pinged as the
    pre-ping would. Under load connections come back within milliseconds and are never
    pinged. (Drivers other than psycopg 3 get the pre-ping.)"""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["checked_in_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _check(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_s = time.monotonic() - record.info.get("checked_in_at", time.monotonic())
        if _server_has_spoken(dbapi_connection) or (
            idle_s > IDLE_PING_S and not _answers_ping(engine, dbapi_connection)
        ):
            # The pool closes this one and checks out another (SQLAlchemy's documented way).
            raise DisconnectionError("the server closed this pooled connection")


def _server_has_spoken(dbapi_connection: Any) -> bool:
    # poll, not select: select refuses descriptors past 1024, which a busy process has.
    poller = select.poll()
    try:
        poller.register(dbapi_connection.pgconn.socket, select.POLLIN)
    except psycopg.OperationalError:  # no socket left at all
        return True
    return bool(poller.poll(0))


def _answers_ping(engine: Engine, dbapi_connection: Any) -> bool:
    try:
        engine.dialect.do_ping(dbapi_connection)
    except Exception:
        return False
    return True


def make_read_engine(url: str, write_engine: Engine) -> Engine:
    """SQLite gets a reader engine of its own. Other databases share the write engine's
    pool, in autocommit: at READ COMMITTED, PostgreSQL's default, each statement sees what
    was committed when it began, in a transaction or not, so a read loses nothing; and it
    saves the BEGIN and the ROLLBACK, each a round trip to the server and a wait for the
    GIL on the way back, which were a quarter of the service's CPU under load."""
    if write_engine.dialect.name != "sqlite":
        return write_engine.execution_options(isolation_level="AUTOCOMMIT")
    return make_engine(url, for_writes=False)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work outside a request (dispatcher, CLI): commit on success, else roll back."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def write_in_transaction(factory: sessionmaker[Session], write: Callable[[Session], T]) -> T:
    """`write(session)`, then commit; roll back if it raises."""
    with transaction(factory) as session:
        return write(session)


def write_if_unlocked(
    factory: sessionmaker[Session], write: Callable[[Session], T]
) -> tuple[bool, T | None]:
    """SQLite: `write_in_transaction` if the database's write lock can be had at once, and
    (True, its result); (False, None), with nothing done, if another connection holds it.
    For a caller that must not wait for the lock where it is (the event loop)."""
    engine: Engine = factory.kw["bind"]
    with engine.connect() as connection:
        driver = connection.connection.driver_connection
        assert driver is not None
        driver.execute("PRAGMA busy_timeout=0")
        try:
            with factory(bind=connection) as session:
                try:
                    session.connection()  # BEGIN IMMEDIATE (see make_engine), or "locked"
                except (OperationalError, sqlite3.OperationalError) as exc:
                    # The begin listener's own error comes unwrapped.
                    if "database is locked" in str(exc):
                        return False, None
                    raise
                # Held: nothing below waits for the lock, and the connection goes back to
                # the pool as it came.
                driver.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
                try:
                    result = write(session)
                    session.commit()
                except BaseException:
                    session.rollback()
                    raise
                return True, result
        finally:
            driver.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
