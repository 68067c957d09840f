"""Request dependencies as `Annotated` aliases, so routes declare what they need by type."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from app.errors import Unauthorized
from app.security import hash_secret
from app.services.api_keys import find_api_key
from app.settings import Settings

T = TypeVar("T")


async def get_settings(request: Request) -> Settings:
    # `async` only so that FastAPI calls it on the event loop: a plain `def` dependency is
    # run in a worker thread, a trip that costs more than the lookup.
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
    try:
        session = factory()
        try:
            yield session
        except BaseException:
            await anyio.to_thread.run_sync(_end_transaction, session, False)
            raise
        # One trip to a worker thread for both commit and close: each trip costs as much as
        # a small query does.
        await anyio.to_thread.run_sync(_end_transaction, session, True)
    finally:
        if lock is not None:
            lock.release()


def _end_transaction(session: Session, commit: bool) -> None:
    try:
        if commit:
            session.commit()
        else:
            session.rollback()
    finally:
        session.close()


async def run_in_read_session(request: Request, read: Callable[[Session], T]) -> T:
    """`read(session)` in a read-only session of its own, for short reads on hot routes
    (status polling). A read has nothing to commit: closing the session ends it, in the same
    call, where `SessionDep` needs a trip to a worker thread of its own after the route.

    SQLite reads run right here, on the event loop: in WAL mode a reader never waits for a
    writer, and a lookup by key takes less time than a trip to a worker thread. Those trips,
    and the handing of the GIL back and forth that comes with them, are what made polling's
    tail latency (BENCHMARKS.md, status polling). Other databases are a network round trip
    away, so their reads go to a worker thread."""
    factory: sessionmaker[Session] = request.app.state.read_session_factory

    def in_session() -> T:
        with factory() as session:
            return read(session)

    if _is_sqlite(factory):
        return in_session()
    return await anyio.to_thread.run_sync(in_session)


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


# A verified API key is remembered this long, so that a client polling many times a second
# costs no database read (and no worker thread) per request to check its key. Keys are
# never deleted today; should revoking one be added, it takes effect within this time.
API_KEY_CACHE_TTL_S = 30.0
API_KEY_CACHE_SIZE = 1024


class _ApiKeyCache:
    """Principals of recently verified keys, by the key's hash. Used from the event loop
    only, so it needs no lock. Unknown keys are not remembered: nothing to fill it with."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, key_hash: str) -> Principal | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        expires, principal = entry
        if expires < time.monotonic():
            del self._entries[key_hash]
            return None
        return principal

    def put(self, key_hash: str, principal: Principal) -> None:
        if len(self._entries) >= API_KEY_CACHE_SIZE:
            self._entries.clear()
        self._entries[key_hash] = (time.monotonic() + API_KEY_CACHE_TTL_S, principal)


def _api_key_cache(request: Request) -> _ApiKeyCache:
    state = request.app.state
    cache: _ApiKeyCache | None = getattr(state, "api_key_cache", None)
    if cache is None:
        cache = state.api_key_cache = _ApiKeyCache()
    return cache


async def get_principal(request: Request, settings: SettingsDep) -> Principal:
    if settings.auth == "disabled":
        return Principal(id=LOCAL_PRINCIPAL, name="local")
    token = bearer_token(request)
    if not token:
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
    cache = _api_key_cache(request)
    key_hash = hash_secret(token)
    principal = cache.get(key_hash)
    if principal is None:
        factory: sessionmaker[Session] = request.app.state.read_session_factory
        principal = await anyio.to_thread.run_sync(_find_principal, factory, token)
        if principal is None:
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
        cache.put(key_hash, principal)
    return principal


def _find_principal(factory: sessionmaker[Session], secret: str) -> Principal | None:
    # A short read of its own, so a write request does not hold the lock while checking.
    with factory() as session:
        key = find_api_key(session, secret=secret)
        return None if key is None else Principal(id=key.id, name=key.name)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
