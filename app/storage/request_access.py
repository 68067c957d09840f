"""How a request reaches the database: `RequestDatabase`, the one object the app holds for it
(`AppState.database`), with the admission that keeps a flood of requests from stalling the
service. Routes take one of its ways through app/api/deps.py, whose docstring says which
kind of route takes which."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar, cast

import anyio
import anyio.to_thread
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from app.storage import db
from app.storage.loop_writes import LoopWriter
from app.storage.slots import Slots

T = TypeVar("T")

_READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class Admission:
    """Why a flood of requests cannot stall the service: the invariant, stated once.

    Every database connection a request uses is taken under a slot awaited here, on the event
    loop, before the work goes to a worker thread: a request waiting for a slot holds neither
    a thread nor a connection. The pools (app/storage/db.py) hold a connection for every slot at
    once, so admitted work never waits for a connection. An admitted session's end (commit or
    rollback, then close, which returns its connection) runs on threads of its own
    (`session_threads`), so it never queues behind routes for one of AnyIO's 40 shared worker
    threads. Before this, up to 40 sessions could hold the pool's 40 connections while
    waiting for a thread to close them, and the 40 threads waited for a connection: nothing
    moved until the pool's 30 s timeout failed them.

    API-key lookups have slots of their own: a lookup runs while its request's session holds
    a slot, and taking a second slot of the same kind could wait on the sessions it holds up.
    (On SQLite a lookup runs on the loop, one at a time, and takes none.) Calls to Ray from
    requests hold no slot (`AppState.ray_calls`): Ray's client waits without a timeout.
    A session slot is never taken while another is held (`read` serves routes without a
    `transaction`). A request's second and later slots go ahead of new requests
    (app/storage/slots.py), so one that needs several waits for admission about once."""

    def __init__(self) -> None:
        self.sessions = Slots(db.REQUEST_SESSION_SLOTS)
        self.session_threads = anyio.CapacityLimiter(db.REQUEST_SESSION_SLOTS)
        self.key_lookups = anyio.CapacityLimiter(db.KEY_LOOKUP_SLOTS)


class RequestDatabase:
    """The sessions, connections and writes of requests, each under `Admission`."""

    def __init__(
        self, session_factory: sessionmaker[Session], read_session_factory: sessionmaker[Session]
    ) -> None:
        self.session_factory = session_factory
        # Reads get sessions that do not queue for SQLite's write lock.
        self.read_session_factory = read_session_factory
        self.admission = Admission()
        # SQLite has one writer at a time; see `transaction`.
        self.sqlite_write_lock = anyio.Lock()
        # SQLite writes on the event loop (`write`).
        self.loop_writer = LoopWriter(session_factory, self.admission.sessions)

    @asynccontextmanager
    async def transaction(self, request: Request) -> AsyncIterator[Session]:
        """The request owns the transaction: commit when the route returns, roll back on
        error. A GET's session is a read session."""
        factory = (
            self.read_session_factory
            if request.method in _READ_ONLY_METHODS
            else self.session_factory
        )
        lock: anyio.Lock | None = None
        if factory is self.session_factory and is_sqlite(factory):
            # SQLite has one writer at a time. Write requests queue here, on the event loop,
            # rather than each holding a worker thread while it waits for the lock. Before the
            # admission slot: a writer waiting for the lock should not keep a reader out.
            lock = self.sqlite_write_lock
            await lock.acquire()
        try:
            async with self.admission.sessions.slot(request):
                session = factory()
                try:
                    yield session
                except BaseException:
                    await self._end(session, commit=False)
                    raise
                await self._end(session, commit=True)
        finally:
            if lock is not None:
                lock.release()

    async def _end(self, session: Session, *, commit: bool) -> None:
        # One trip to a worker thread for both commit and close: each trip costs as much as a
        # small query does. Shielded: the slot must not be given back before the connection is.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(
                _end_transaction, session, commit, limiter=self.admission.session_threads
            )

    async def read(
        self, request: Request, read: Callable[[Session], T], *, blocking: bool = False
    ) -> T:
        """`read(session)` in a read-only session of its own, for short reads on hot routes
        (status polling). A read has nothing to commit: closing the session ends it, in the same
        call, where `transaction` needs a trip to a worker thread of its own after the route.

        SQLite reads run right here, on the event loop: in WAL mode a reader never waits for a
        writer, and a lookup by key takes less time than a trip to a worker thread. Those trips,
        and the handing of the GIL back and forth that comes with them, are what made polling's
        tail latency (BENCHMARKS.md, status polling). Other databases are a network round trip
        away, so their reads go to a worker thread. Either way under an admission slot: the
        connection it takes is one the pool keeps for it.

        `blocking`: the read does more than a lookup (validation reads model and dataset files,
        and may wait for the cluster's nodes): a worker thread on every database."""
        factory = self.read_session_factory

        def in_session() -> T:
            with factory() as session:
                return read(session)

        return await self._admitted_read(request, in_session, blocking=blocking)

    async def read_connection(self, request: Request, read: Callable[[Connection], T]) -> T:
        """`read` for a read that is a statement or two on a connection and needs
        no ORM session (status polling: beginning and closing a session cost as much as the
        statement)."""
        engine: Engine = self.read_session_factory.kw["bind"]

        def on_connection() -> T:
            with engine.connect() as connection:
                return read(connection)

        return await self._admitted_read(request, on_connection, blocking=False)

    async def _admitted_read(self, request: Request, call: Callable[[], T], *, blocking: bool) -> T:
        async with self.admission.sessions.slot(request):
            if is_sqlite(self.read_session_factory) and not blocking:
                return call()
            with anyio.CancelScope(shield=True):
                result = await anyio.to_thread.run_sync(
                    call, limiter=self.admission.session_threads
                )
            return result

    async def write(self, request: Request, write: Callable[[Session], T]) -> T:
        """`write(session)` and its commit (or rollback, if it raises), for write routes that
        do their reading of files and the cluster first (`read`): `write` touches the
        database alone.

        On SQLite the write runs right here on the event loop, as reads do (`read`): a few
        statements on a local file, at once when the database's lock is free, else in the
        process's queue of such writes (app/storage/loop_writes.py). What that avoids is what
        200 clients measured (BENCHMARKS.md, load): writers queued, each making trips to a
        worker thread under the lock, waiting on every trip for a thread, a connection and
        the GIL of a busy loop, seconds in all. Other databases are a network round trip
        away: a worker thread always."""
        factory = self.session_factory
        if is_sqlite(factory):
            return cast(T, await self.loop_writer.write(request, write))
        async with self.admission.sessions.slot(request):
            # Shielded: the slot must not be given back before the connection is.
            with anyio.CancelScope(shield=True):
                result = await anyio.to_thread.run_sync(
                    db.write_in_transaction,
                    factory,
                    write,
                    limiter=self.admission.session_threads,
                )
        return cast(T, result)


def _end_transaction(session: Session, commit: bool) -> None:
    try:
        if commit:
            session.commit()
        else:
            session.rollback()
    finally:
        session.close()


def is_sqlite(factory: sessionmaker[Session]) -> bool:
    bind = factory.kw.get("bind")
    return bind is not None and bind.dialect.name == "sqlite"
