"""Request dependencies as `Annotated` aliases, so routes declare what they need by type.

A route reaches the database one way, chosen by its kind; each is a way of the one
`RequestDatabase` the app holds (app/storage/request_access.py), under its admission:

| the route                                                        | its way                  |
| ---------------------------------------------------------------- | ------------------------ |
| reads and writes a few rows, in one transaction it owns          | `SessionDep`             |
| a hot read of the caller's own rows (status polling)             | `read_as_caller`         |
| a hot read of a statement or two, without the ORM                | `run_on_read_connection` |
| any other read (`blocking=True`: it reads files, waits on Ray)   | `run_in_read_session`    |
| the write after such reads, touching the database alone          | `run_in_write_session`   |

A route that reads files or the cluster does that outside any write (SQLite's write lock
is the whole service's): `run_in_read_session(..., blocking=True)`, then
`run_in_write_session`, as the create route does (app/api/run_creation.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

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
from app.storage.request_access import RequestDatabase, is_sqlite
from contract.graders.grading import Runners
from contract.graders.sandbox import PythonSandbox

T = TypeVar("T")


@dataclass(slots=True)
class AppState:
    """Everything the app holds for its routes, typed (kept as `app.state.tuneyard`)."""

    settings: Settings
    # How requests reach the database (sessions, reads, writes, their admission).
    database: RequestDatabase
    metrics: ServiceMetrics
    # Set while attached to Ray (not in `start_background=False` apps).
    jobs: RayJobs | None = None
    dispatcher: Dispatcher | None = None
    # The cluster's nodes, for refusing runs it can never place (None without Ray).
    cluster: ClusterView | None = None
    # Calls to Ray's dashboard from requests (health, a job's log), which Ray's client makes
    # with no timeout: threads of their own, outside the database's admission.
    ray_calls: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(8))
    # The profiles this process runs (`POST /v1/runs/validate` with `profile: true`).
    profile_slots: ProfileSlots = field(init=False)
    # What the settings say to a request's checks, and to whatever ends a run or enqueues a
    # webhook: made once, passed to them as arguments.
    policy: RequestPolicy = field(init=False)

    # Where graders run that cannot run in-process (Python graders' sandbox, when on), and
    # how many Python graders may run at once.
    graders: Runners = field(init=False)
    python_graders: anyio.CapacityLimiter = field(init=False)
    # Threads for the other graders on /graders/run (anyio's default pool is every sync
    # route's too).
    grading_threads: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(4))

    def __post_init__(self) -> None:
        self.profile_slots = ProfileSlots(self.settings.max_concurrent_profiles)
        self.policy = self.settings.request_policy()
        # SandboxUnavailable (no bwrap) stops the service starting with them on.
        sandbox = PythonSandbox() if self.settings.python_graders else None
        budget = sandbox.limits.timeout_s if sandbox else 0.0
        self.graders = Runners(python=sandbox, python_budget_s=budget)
        self.python_graders = anyio.CapacityLimiter(self.settings.max_concurrent_python_graders)

    @property
    def hooks(self) -> WebhookConfig:
        return self.policy.webhooks


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


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request owns the transaction: commit when the route returns, roll back on error."""
    async with app_state(request).database.transaction(request) as session:
        yield session


async def run_in_read_session(
    request: Request, read: Callable[[Session], T], *, blocking: bool = False
) -> T:
    """`read(session)` in a read session of its own (`RequestDatabase.read`); `blocking`:
    the read does more than a lookup (files, the cluster)."""
    return await app_state(request).database.read(request, read, blocking=blocking)


async def run_on_read_connection(request: Request, read: Callable[[Connection], T]) -> T:
    """`read(connection)`, a statement or two with no ORM session
    (`RequestDatabase.read_connection`)."""
    return await app_state(request).database.read_connection(request, read)


async def run_in_write_session(request: Request, write: Callable[[Session], T]) -> T:
    """`write(session)` and its commit, after the route's reads (`RequestDatabase.write`)."""
    return await app_state(request).database.write(request, write)


LOCAL_PRINCIPAL = "local"

SettingsDep = Annotated[Settings, Depends(get_settings)]
HooksDep = Annotated[WebhookConfig, Depends(get_hooks)]
JobsDep = Annotated[RayJobs | None, Depends(get_jobs)]
DispatcherDep = Annotated[Dispatcher | None, Depends(get_dispatcher)]
ClusterDep = Annotated[ClusterView | None, Depends(get_cluster)]
ProfileSlotsDep = Annotated[ProfileSlots, Depends(get_profile_slots)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
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
    factory = state.database.read_session_factory
    limiter = state.database.admission.key_lookups
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
