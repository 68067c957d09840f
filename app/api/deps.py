"""Request dependencies as `Annotated` aliases, so routes declare what they need by type."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from app.dispatch import Dispatcher
from app.errors import Unauthorized
from app.metrics import ServiceMetrics
from app.ray_jobs import RayJobs
from app.security import hash_secret
from app.services.api_keys import find_api_key
from app.services.placement import ClusterView
from app.settings import Settings

T = TypeVar("T")


@dataclass(slots=True)
class AppState:
    """Everything the app holds for its routes, typed (kept as `app.state.tuneyard`)."""

    settings: Settings
    session_factory: sessionmaker[Session]
    # Reads get sessions that do not queue for SQLite's write lock.
    read_session_factory: sessionmaker[Session]
    metrics: ServiceMetrics
    # SQLite has one writer at a time; see get_session.
    sqlite_write_lock: anyio.Lock = field(default_factory=anyio.Lock)
    # Set while attached to Ray (not in `start_background=False` apps).
    jobs: RayJobs | None = None
    dispatcher: Dispatcher | None = None
    # The cluster's nodes, for refusing runs it can never place (None without Ray).
    cluster: ClusterView | None = None
    api_key_cache: _ApiKeyCache = field(default_factory=lambda: _ApiKeyCache())


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.tuneyard
    return state


# The dependencies below are `async` only so that FastAPI calls them on the event loop: a
# plain `def` dependency is run in a worker thread, a trip that costs more than the lookup.


async def get_settings(request: Request) -> Settings:
    return app_state(request).settings


async def get_jobs(request: Request) -> RayJobs | None:
    return app_state(request).jobs


async def get_dispatcher(request: Request) -> Dispatcher | None:
    return app_state(request).dispatcher


async def get_cluster(request: Request) -> ClusterView | None:
    return app_state(request).cluster


async def get_metrics(request: Request) -> ServiceMetrics:
    return app_state(request).metrics


async def get_read_session_factory(request: Request) -> sessionmaker[Session]:
    return app_state(request).read_session_factory


_READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _factory(request: Request) -> sessionmaker[Session]:
    """Reads get sessions that do not queue for SQLite's write lock."""
    state = app_state(request)
    if request.method in _READ_ONLY_METHODS:
        return state.read_session_factory
    return state.session_factory


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request owns the transaction: commit when the route returns, roll back on error."""
    factory = _factory(request)
    lock: anyio.Lock | None = None
    if factory is app_state(request).session_factory and _is_sqlite(factory):
        # SQLite has one writer at a time. Write requests queue here, on the event loop,
        # rather than each holding a worker thread while it waits for the lock: with every
        # pool thread waiting, the holder could not get one to finish its response.
        lock = app_state(request).sqlite_write_lock
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
    factory = app_state(request).read_session_factory

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
JobsDep = Annotated[RayJobs | None, Depends(get_jobs)]
DispatcherDep = Annotated[Dispatcher | None, Depends(get_dispatcher)]
ClusterDep = Annotated[ClusterView | None, Depends(get_cluster)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
ReadSessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_read_session_factory)]
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


async def get_principal(request: Request, settings: SettingsDep) -> Principal:
    if settings.auth == "disabled":
        return Principal(id=LOCAL_PRINCIPAL, name="local")
    token = bearer_token(request)
    if not token:
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
    cache = app_state(request).api_key_cache
    key_hash = hash_secret(token)
    principal = cache.get(key_hash)
    if principal is None:
        factory = app_state(request).read_session_factory
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
