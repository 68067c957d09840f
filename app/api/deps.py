"""Request dependencies as `Annotated` aliases, so routes declare what they need by type."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

import anyio
import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from app.errors import Unauthorized
from app.services.api_keys import find_api_key
from app.settings import Settings


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


_READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _factory(request: Request) -> sessionmaker[Session]:
    """Reads get sessions that do not queue for SQLite's write lock."""
    state = request.app.state
    factory: sessionmaker[Session] = (
        state.read_session_factory
        if request.method in _READ_ONLY_METHODS
        else state.session_factory
    )
    return factory


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request owns the transaction: commit when the route returns, roll back on error."""
    factory = _factory(request)
    lock: anyio.Lock | None = None
    if factory is request.app.state.session_factory and _is_sqlite(factory):
        # SQLite has one writer at a time. Write requests queue here, on the event loop,
        # rather than each holding a worker thread while it waits for the lock: with every
        # pool thread waiting, the holder could not get one to finish its response.
        lock = request.app.state.sqlite_write_lock
        await lock.acquire()
    session = factory()
    try:
        yield session
        await anyio.to_thread.run_sync(session.commit)
    except BaseException:
        await anyio.to_thread.run_sync(session.rollback)
        raise
    finally:
        await anyio.to_thread.run_sync(session.close)
        if lock is not None:
            lock.release()


def _is_sqlite(factory: sessionmaker[Session]) -> bool:
    bind = factory.kw.get("bind")
    return bind is not None and bind.dialect.name == "sqlite"


LOCAL_PRINCIPAL = "local"

SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": commit before the response is sent, so a client never reads stale data.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling; with auth disabled (loopback only) everyone is the one `local` user."""

    id: str
    name: str


def get_principal(request: Request, settings: SettingsDep) -> Principal:
    if settings.auth == "disabled":
        return Principal(id=LOCAL_PRINCIPAL, name="local")
    token = bearer_token(request)
    key = None
    if token:
        # A short read of its own, so a write request does not hold the lock while checking.
        with request.app.state.read_session_factory() as session:
            key = find_api_key(session, secret=token)
    if key is None:
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
    return Principal(id=key.id, name=key.name)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
