"""Request dependencies as `Annotated` aliases, so routes declare what they need by type."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar, cast

import anyio
import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import RayJobs
from app.errors import Unauthorized
from app.metrics import ServiceMetrics
from app.services.api_keys import find_api_key
from app.services.dispatch import Dispatcher
from app.services.placement import ClusterView
from app.services.profiles import ProfileSlots
from app.services.rules.run_rules import RequestPolicy
from app.services.rules.webhook_rules import WebhookConfig
from app.settings import Settings
from app.storage import db
from app.storage.loop_writes import LoopWriter
from app.storage.slots import Slots

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
    # Admission of database work (sized in app/storage/db.py, read when the app is made; see
    # `Admission` for why).
    admission: Admission = field(default_factory=lambda: Admission())
    # SQLite writes on the event loop (`run_in_write_session`).
    loop_writer: LoopWriter = field(init=False)
    # Calls to Ray's dashboard from requests (health, a job's log), which Ray's client makes
    # with no timeout: threads of their own, outside the database's admission.
    ray_calls: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(8))
    # The profiles this process runs (`POST /v1/runs/validate` with `profile: true`).
    profile_slots: ProfileSlots = field(init=False)
    # What the settings say to a request's checks, and to whatever ends a run or enqueues a
    # webhook: made once, passed to them as arguments.
    policy: RequestPolicy = field(init=False)
    hooks: WebhookConfig = field(init=False)

    def __post_init__(self) -> None:
        self.loop_writer = LoopWriter(self.session_factory, self.admission.sessions)
        self.profile_slots = ProfileSlots(self.settings.max_concurrent_profiles)
        self.policy = self.settings.request_policy()
        self.hooks = self.policy.webhooks


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.tuneyard
    return state


# The dependencies below are `async` only so that FastAPI calls them on the event loop: a
# plain `def` dependency is run in a worker thread, a trip that costs more than the lookup.


async def get_settings(request: Request) -> Settings:
    return app_state(request).settings


async def get_hooks(request: Request) -> WebhookConfig:
    """The service's webhook settings, for whatever ends a run or enqueues a webhook."""
    return app_state(request).hooks


async def get_jobs(request: Request) -> RayJobs | None:
    return app_state(request).jobs


async def get_dispatcher(request: Request) -> Dispatcher | None:
    return app_state(request).dispatcher


async def get_cluster(request: Request) -> ClusterView | None:
    return app_state(request).cluster


async def get_profile_slots(request: Request) -> ProfileSlots:
    return app_state(request).profile_slots


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
    A session slot is never taken while another is held (`run_in_read_session` serves routes
    without `SessionDep`). A request's second and later slots go ahead of new requests
    (app/storage/slots.py), so one that needs several waits for admission about once."""

    def __init__(self) -> None:
        self.sessions = Slots(db.REQUEST_SESSION_SLOTS)
        self.session_threads = anyio.CapacityLimiter(db.REQUEST_SESSION_SLOTS)
        self.key_lookups = anyio.CapacityLimiter(db.KEY_LOOKUP_SLOTS)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request owns the transaction: commit when the route returns, roll back on error."""
    state = app_state(request)
    factory = _factory(request)
    lock: anyio.Lock | None = None
    if factory is state.session_factory and is_sqlite(factory):
        # SQLite has one writer at a time. Write requests queue here, on the event loop,
        # rather than each holding a worker thread while it waits for the lock. Before the
        # admission slot: a writer waiting for the lock should not keep a reader out.
        lock = state.sqlite_write_lock
        await lock.acquire()
    try:
        async with state.admission.sessions.slot(request):
            session = factory()
            try:
                yield session
            except BaseException:
                await _end(state, session, commit=False)
                raise
            await _end(state, session, commit=True)
    finally:
        if lock is not None:
            lock.release()


async def _end(state: AppState, session: Session, *, commit: bool) -> None:
    # One trip to a worker thread for both commit and close: each trip costs as much as a
    # small query does. Shielded: the slot must not be given back before the connection is.
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(
            _end_transaction, session, commit, limiter=state.admission.session_threads
        )


def _end_transaction(session: Session, commit: bool) -> None:
    try:
        if commit:
            session.commit()
        else:
            session.rollback()
    finally:
        session.close()


async def run_in_read_session(
    request: Request, read: Callable[[Session], T], *, blocking: bool = False
) -> T:
    """`read(session)` in a read-only session of its own, for short reads on hot routes
    (status polling). A read has nothing to commit: closing the session ends it, in the same
    call, where `SessionDep` needs a trip to a worker thread of its own after the route.

    SQLite reads run right here, on the event loop: in WAL mode a reader never waits for a
    writer, and a lookup by key takes less time than a trip to a worker thread. Those trips,
    and the handing of the GIL back and forth that comes with them, are what made polling's
    tail latency (BENCHMARKS.md, status polling). Other databases are a network round trip
    away, so their reads go to a worker thread. Either way under an admission slot: the
    connection it takes is one the pool keeps for it.

    `blocking`: the read does more than a lookup (validation reads model and dataset files,
    and may wait for the cluster's nodes): a worker thread on every database."""
    factory = app_state(request).read_session_factory

    def in_session() -> T:
        with factory() as session:
            return read(session)

    return await _admitted_read(request, in_session, blocking=blocking)


async def run_on_read_connection(request: Request, read: Callable[[Connection], T]) -> T:
    """`run_in_read_session` for a read that is a statement or two on a connection and needs
    no ORM session (status polling: beginning and closing a session cost as much as the
    statement)."""
    engine: Engine = app_state(request).read_session_factory.kw["bind"]

    def on_connection() -> T:
        with engine.connect() as connection:
            return read(connection)

    return await _admitted_read(request, on_connection, blocking=False)


async def _admitted_read(request: Request, call: Callable[[], T], *, blocking: bool) -> T:
    state = app_state(request)
    async with state.admission.sessions.slot(request):
        if is_sqlite(state.read_session_factory) and not blocking:
            return call()
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(call, limiter=state.admission.session_threads)
        return result


async def run_in_write_session(request: Request, write: Callable[[Session], T]) -> T:
    """`write(session)` and its commit (or rollback, if it raises), for write routes that do
    their reading of files and the cluster first (`run_in_read_session`): `write` touches
    the database alone.

    On SQLite the write runs right here on the event loop, as reads do
    (`run_in_read_session`): a few statements on a local file, at once when the database's
    lock is free, else in the process's queue of such writes (app/storage/loop_writes.py). What
    that avoids is what 200 clients measured (BENCHMARKS.md, load): writers queued, each
    making trips to a worker thread under the lock, waiting on every trip for a thread, a
    connection and the GIL of a busy loop, seconds in all. Other databases are a network
    round trip away: a worker thread always."""
    state = app_state(request)
    factory = state.session_factory
    if is_sqlite(factory):
        return cast(T, await state.loop_writer.write(request, write))
    async with state.admission.sessions.slot(request):
        # Shielded: the slot must not be given back before the connection is.
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(
                db.write_in_transaction,
                factory,
                write,
                limiter=state.admission.session_threads,
            )
    return cast(T, result)


def is_sqlite(factory: sessionmaker[Session]) -> bool:
    bind = factory.kw.get("bind")
    return bind is not None and bind.dialect.name == "sqlite"


LOCAL_PRINCIPAL = "local"

SettingsDep = Annotated[Settings, Depends(get_settings)]
HooksDep = Annotated[WebhookConfig, Depends(get_hooks)]
JobsDep = Annotated[RayJobs | None, Depends(get_jobs)]
DispatcherDep = Annotated[Dispatcher | None, Depends(get_dispatcher)]
ClusterDep = Annotated[ClusterView | None, Depends(get_cluster)]
ProfileSlotsDep = Annotated[ProfileSlots, Depends(get_profile_slots)]
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


async def get_principal(request: Request, settings: SettingsDep) -> Principal:
    """One indexed lookup per request, no cache: a revoked key (`tuneyard keys revoke`) is
    refused from the next request on, by every process that shares the database."""
    if settings.auth == "disabled":
        return Principal(id=LOCAL_PRINCIPAL, name="local")
    token = bearer_token(request)
    principal = None if not token else await _find_principal(app_state(request), token)
    if principal is None:
        raise unauthorized()
    return principal


async def _find_principal(state: AppState, secret: str) -> Principal | None:
    # A short read of its own, so a write request does not hold the lock while checking. On
    # SQLite on the event loop, as in `run_in_read_session`, with no admission: lookups on
    # the loop run one at a time, so they never hold more than one connection. (Taking an
    # anyio limiter yields to the loop with the token held: under load, four lookups per
    # loop iteration, and creates and validations waited most of a second for them.)
    # Elsewhere on a thread of the lookups' own, whose limiter is their admission.
    factory = state.read_session_factory
    limiter = state.admission.key_lookups
    if is_sqlite(factory):
        return _lookup(factory, secret)
    with anyio.CancelScope(shield=True):
        principal = await anyio.to_thread.run_sync(_lookup, factory, secret, limiter=limiter)
    return principal


def _lookup(factory: sessionmaker[Session], secret: str) -> Principal | None:
    engine: Engine = factory.kw["bind"]
    with engine.connect() as connection:
        key = find_api_key(connection, secret=secret)
        return None if key is None else Principal(id=key.id, name=key.name)


async def read_as_caller(request: Request, read: Callable[[Session, Principal], T]) -> T:
    """`read(session, caller)` in a read session (`run_in_read_session`) that checks the
    caller's key first, on the same connection: for the hot polling routes, which would
    otherwise take two connections from the pool, one for `get_principal`'s lookup and one
    for the read. The rule is the same: no cache, a revoked key is refused at once."""
    if app_state(request).settings.auth == "disabled":
        local = Principal(id=LOCAL_PRINCIPAL, name="local")
        return await run_in_read_session(request, lambda session: read(session, local))
    secret = bearer_token(request)
    if not secret:
        raise unauthorized()

    def checked(session: Session) -> T:
        key = find_api_key(session, secret=secret)
        if key is None:
            raise unauthorized()
        return read(session, Principal(id=key.id, name=key.name))

    return await run_in_read_session(request, checked)


async def bearer_present(request: Request) -> None:
    """401 at once for a request with no key at all, before its parameters are checked, for
    routes that check the key itself together with their read (`read_as_caller`)."""
    if app_state(request).settings.auth != "disabled" and not bearer_token(request):
        raise unauthorized()


BearerPresent = Depends(bearer_present)


def unauthorized() -> Unauthorized:
    return Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
