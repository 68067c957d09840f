"""The shared queue in the database: one scheduling pass, positions, and per-key limits.

The rules are app/services/scheduling.py's; this module feeds them the runs and limits the
database holds and writes back what they decided. A pass holds the scheduler's lock for
its whole transaction (PostgreSQL: an advisory lock; SQLite: the one write lock every write
transaction takes), so that service replicas decide one after another, each seeing the
claims the last one committed: a key's limits hold across replicas because the database
decides, not one process's memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, select, text, update
from sqlalchemy.orm import Session

from app.errors import TooManyRequests, Unauthorized, ValidationFailed, field_problem
from app.schemas.run_view import RunFields, as_utc
from app.services import lifecycle
from app.services.lifecycle import preempted_reason
from app.services.rules.webhook_rules import WebhookConfig
from app.services.scheduling import (
    Ask,
    KeyLimits,
    Live,
    Policy,
    Queued,
    Usage,
    place,
    plan,
    queue_order,
)
from app.settings import Settings
from app.storage.models import ApiKey, Run
from contract.run_request import DEFAULT_PRIORITY
from contract.statuses import RunStatus

LIVE = (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.PREEMPTING, RunStatus.CANCELLING)
# Any constant both replicas agree on: the key of PostgreSQL's advisory lock for a pass.
SCHEDULER_LOCK = 0x7475_6E65  # "tune"
# Ray's report of what is taken lags: the monitor refreshes it every few seconds, and a
# job's workers are placed some seconds after it is submitted. Until then, a run just
# started is counted as taking its resources on top of what Ray reports.
ASSUMED_PENDING = timedelta(seconds=30)


@dataclass(frozen=True, slots=True)
class NeverFits:
    """A queued run the cluster's nodes can never hold: why, and whether it fails now (else
    it waits, out of the scheduler's way, for a node that can hold it, saying `why`)."""

    why: str
    fail: bool


def schedule(
    session: Session,
    *,
    settings: Settings,
    hooks: WebhookConfig,
    free_nodes: list[dict[str, float]] | None,
    now: datetime,
    free_reported: bool = True,
    never_fits: Callable[[str, dict[str, Any]], NeverFits | None] | None = None,
) -> list[tuple[str, datetime]]:
    """One scheduling pass in the caller's transaction: the runs to claim (id, queued_at),
    with every waiting run's reason written and the preemptions requested. The caller
    claims the runs in this same transaction, before the lock is let go. `never_fits(id,
    spec)`: whether the cluster can never hold a queued run (None: it may). Such a run
    fails, or waits with that reason; either way it is not scheduled, so that it neither
    holds back runs of lower priority nor preempts any. `free_reported`: whether
    `free_nodes` is Ray's report of what is free (else the nodes' totals, from which every
    live run's share is taken here)."""
    _lock(session)
    live_rows = list(
        session.execute(
            select(
                Run.id,
                Run.owner_id,
                Run.priority,
                Run.spec,
                Run.status,
                Run.preemptible,
                Run.attempt_started_at,
                Run.preempt_requested_at,
            ).where(Run.status.in_(LIVE))
        )
    )
    live = [
        Live(
            id=row.id,
            owner=row.owner_id or "",
            priority=row.priority,
            ask=Ask.of_spec(row.spec),
            preemptible=row.preemptible and row.status == RunStatus.RUNNING,
            running_since=as_utc(row.attempt_started_at),
            # A cancel under way stops it anyway: it is no preemption that blocks another.
            preempting=row.status == RunStatus.PREEMPTING,
        )
        for row in live_rows
    ]
    queued_rows = list(
        session.execute(
            select(
                Run.id,
                Run.owner_id,
                Run.priority,
                Run.queued_at,
                Run.spec,
                Run.queue_reason,
                Run.preempt_requested_at,
                Run.step,
            ).where(Run.status == RunStatus.QUEUED)
        )
    )
    # Runs the cluster's nodes can never hold (validation would refuse them now), and the
    # reasons of those that wait still.
    unplaceable: dict[str, str | None] = {}
    if never_fits is not None:
        for row in list(queued_rows):
            verdict = never_fits(row.id, row.spec)
            if verdict is None:
                continue
            queued_rows.remove(row)
            if not verdict.fail:
                if (reason := _reason(row, verdict.why)) != row.queue_reason:
                    unplaceable[row.id] = reason
                continue
            doomed = session.get(Run, row.id, with_for_update=True)
            if doomed is not None and doomed.run_status == RunStatus.QUEUED:
                lifecycle.fail_unplaceable(session, doomed, message=verdict.why, hooks=hooks)
    if unplaceable:
        session.execute(
            update(Run),
            [{"id": run_id, "queue_reason": reason} for run_id, reason in unplaceable.items()],
            execution_options={"synchronize_session": False},
        )
    if not queued_rows:
        return []
    queued = [
        Queued(
            id=row.id,
            owner=row.owner_id or "",
            priority=row.priority,
            queued_at=as_utc(row.queued_at) or now,
            ask=Ask.of_spec(row.spec),
        )
        for row in queued_rows
    ]
    if free_nodes is not None:
        for run, row in zip(live, live_rows, strict=True):
            just_started = run.running_since is None or now - run.running_since < ASSUMED_PENDING
            # Ray's report counts what runs hold once it shows them; the nodes' totals
            # (`free_reported` False) count none of it.
            if not free_reported or (row.status != RunStatus.CANCELLING and just_started):
                free_nodes = place(run.ask, free_nodes) or free_nodes
    # A run preempted moments ago: its job may still be releasing what it held, and Ray's
    # report shows that late. Until then no other run is preempted, lest one preemption's
    # worth of room cost two runs their place.
    releasing = any(
        row.preempt_requested_at is not None
        and now - (as_utc(row.queued_at) or now) < ASSUMED_PENDING
        for row in queued_rows
    )
    decided = plan(
        queued,
        live,
        releasing=releasing,
        limits=key_limits(session, {run.owner for run in queued}),
        free_nodes=free_nodes,
        policy=Policy(
            max_concurrent_runs=settings.max_concurrent_runs,
            preemption=settings.preemption,
            min_run_time=timedelta(seconds=settings.preemption_min_run_s),
        ),
        now=now,
    )
    changed = [
        {"id": row.id, "queue_reason": reason}
        for row in queued_rows
        if (reason := _reason(row, decided.reasons.get(row.id))) is not None
        and reason != row.queue_reason
    ]
    if changed:
        # One executemany by primary key: a long queue's reasons change together (a run
        # started, a node joined), and a statement per row was most of a pass's time.
        session.execute(update(Run), changed, execution_options={"synchronize_session": False})
    for preemption in decided.preempt:
        victim = session.get(Run, preemption.victim, with_for_update=True)
        if victim is not None:
            lifecycle.request_preemption(session, victim, reason=preemption.reason)
    queued_at = {run.id: run.queued_at for run in queued}
    return [(run_id, queued_at[run_id]) for run_id in decided.start]


def _reason(row: Any, reason: str | None) -> str | None:
    """The reason a queued run is shown. A preempted run says so until it starts again,
    then why it waits now (at first, why it was preempted)."""
    if reason is None or row.preempt_requested_at is None:
        return reason
    return preempted_reason(row.step, reason)


def _lock(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEDULER_LOCK})


def key_limits(session: Session, owners: set[str]) -> dict[str, KeyLimits]:
    if not owners:
        return {}
    rows = session.execute(
        select(ApiKey.id, ApiKey.max_running_runs, ApiKey.max_gpus).where(ApiKey.id.in_(owners))
    )
    return {row.id: KeyLimits(row.max_running_runs, row.max_gpus) for row in rows}


# -- positions ------------------------------------------------------------------------------


def ordered_queue(db: Session | Connection) -> list[Queued]:
    """Every queued run in the order the scheduler takes them (its fair share counts the
    keys' live runs). Two queries whatever the queue's length.

    Every create and every list of queued runs reads the whole queue, so the rows are read
    on the Core connection (no ORM loading) and each becomes its Queued with no more than
    it needs: this was a quarter of the service's CPU under load (BENCHMARKS.md)."""
    if isinstance(db, Session):
        db.flush()  # the caller's pending changes count, as a Session.execute would see them
        connection = db.connection()
    else:
        connection = db
    usage: dict[str, Usage] = {}
    for owner, runs, gpus in connection.execute(
        select(Run.owner_id, func.count(), func.coalesce(func.sum(Run.gpus), 0))
        .where(Run.status.in_(LIVE))
        .group_by(Run.owner_id)
    ):
        usage[owner or ""] = Usage(int(runs), int(gpus))
    queued = [
        Queued(run_id, owner or "", priority, as_utc(queued_at) or queued_at, _gpu_ask(gpus))
        for run_id, owner, priority, queued_at, gpus in connection.execute(
            select(Run.id, Run.owner_id, Run.priority, Run.queued_at, Run.gpus).where(
                Run.status == RunStatus.QUEUED
            )
        ).all()  # one fetch: iterating a result fetches row by row
    ]
    return queue_order(queued, usage)


@functools.cache
def _gpu_ask(gpus: int) -> Ask:
    """What the order needs of a queued run's ask, its GPUs (one shared Ask per count)."""
    return Ask(workers=1, per_worker={"GPU": float(gpus)} if gpus else {})


def queue_positions(db: Session | Connection, runs: Sequence[RunFields]) -> dict[str, int]:
    """The queued ones among `runs` by id, each with its place in the scheduler's order
    (1: the next to start, if the cluster has room)."""
    if not any(r.status == RunStatus.QUEUED for r in runs):
        return {}
    wanted = {r.id for r in runs}
    return {
        run.id: position
        for position, run in enumerate(ordered_queue(db), start=1)
        if run.id in wanted
    }


# -- a key's limits at submission -----------------------------------------------------------


def check_submission(
    session: Session,
    *,
    owner_id: str,
    priority: int | None,
    gpus: int,
    preemptible: bool = True,
    queuing: bool = True,
) -> int:
    """Refuse what the caller's API key may not ask: a priority above its max_priority,
    more GPUs than its max_gpus, a non-preemptible run it is not allowed (422: it would
    never start), or one more queued run than max_queued_runs (429: it may try again once
    some have started). The key's row is locked
    for the caller's transaction, so concurrent submissions, on any replica, count each
    other. A caller without a key (auth disabled) has no limits.

    Returns the run's priority: the one asked, or (`priority` None, not asked) the default
    capped at the key's max_priority, so that a key limited below the default can still
    submit without naming one (OpenAI's clients cannot)."""
    key = session.get(ApiKey, owner_id, with_for_update=queuing)
    if key is not None and key.revoked_at is not None:
        # Revoked while the request's files were being checked, before this transaction.
        raise Unauthorized("this API key was revoked")
    if priority is None:
        priority = DEFAULT_PRIORITY
        if key is not None and key.max_priority is not None:
            priority = min(priority, key.max_priority)
    if key is None:
        return priority
    problems = []
    if key.max_priority is not None and priority > key.max_priority:
        problems.append(
            field_problem(
                "priority",
                f"priority {priority} is above this API key's max_priority "
                f"({key.max_priority}); ask for {key.max_priority} or less, or ask an "
                "operator to raise it (tuneyard keys update)",
            )
        )
    if key.max_gpus is not None and gpus > key.max_gpus:
        problems.append(
            field_problem(
                "resources.num_workers",
                f"the run asks for {gpus} GPUs, more than this API key's max_gpus "
                f"({key.max_gpus}) allows at once: it could never start",
            )
        )
    if not preemptible and not allows_non_preemptible(key):
        problems.append(field_problem("preemptible", _non_preemptible_refusal(key)))
    if problems:
        raise ValidationFailed(problems)
    if queuing and key.max_queued_runs is not None:
        waiting = (
            session.scalar(
                select(func.count()).where(Run.owner_id == owner_id, Run.status == RunStatus.QUEUED)
            )
            or 0
        )
        if waiting >= key.max_queued_runs:
            raise TooManyRequests(
                f"this API key has {waiting} runs queued, its max_queued_runs is "
                f"{key.max_queued_runs}: wait until some start, or cancel some"
            )
    return priority


def check_profile(session: Session, *, owner_id: str, gpus: int) -> None:
    """Refuse a profile (`POST /v1/runs/validate` with `profile: true`) that the caller's API
    key has no room for. A profile is a run-sized Ray job that starts at once, past the
    queue, so it passes the door a create passes (max_queued_runs) and the one the scheduler
    starts runs through (max_running_runs and max_gpus, with the key's live runs counted).
    429, as a create past max_queued_runs is: it may be asked again once runs have moved
    on. How many profiles run at once is app/services/profiles.py's `ProfileSlots`."""
    key = session.get(ApiKey, owner_id)
    if key is None:
        return
    queued = live = live_gpus = 0
    for status, runs, held in session.execute(
        select(Run.status, func.count(), func.coalesce(func.sum(Run.gpus), 0))
        .where(Run.owner_id == owner_id, Run.status.in_((RunStatus.QUEUED, *LIVE)))
        .group_by(Run.status)
    ):
        if status == RunStatus.QUEUED:
            queued += int(runs)
        else:
            live, live_gpus = live + int(runs), live_gpus + int(held)
    rule = "a profile runs on the cluster as a run does, and this API key"
    if key.max_queued_runs is not None and queued >= key.max_queued_runs:
        raise TooManyRequests(
            f"{rule} has {queued} runs queued, its max_queued_runs is {key.max_queued_runs}: "
            "profile once some have started, or cancel some"
        )
    if key.max_running_runs is not None and live >= key.max_running_runs:
        raise TooManyRequests(
            f"{rule} has {live} runs live, its max_running_runs is {key.max_running_runs}: "
            "profile once one has ended"
        )
    if key.max_gpus is not None and live_gpus + gpus > key.max_gpus:
        raise TooManyRequests(
            f"{rule} has {live_gpus} of its max_gpus ({key.max_gpus}) in use by live runs; the "
            f"profile needs {gpus} more: profile once some are free"
        )


def allows_non_preemptible(key: ApiKey) -> bool:
    """Whether the key's runs may set `preemptible: false`: as its operator said
    (allow_non_preemptible), or else unless max_priority caps the key. A capped key's run
    that no higher priority can take back would hold its resources past the cap's intent."""
    if key.allow_non_preemptible is not None:
        return key.allow_non_preemptible
    return key.max_priority is None


def _non_preemptible_refusal(key: ApiKey) -> str:
    why = (
        "allow_non_preemptible is off for this API key"
        if key.allow_non_preemptible is False
        else f"this API key is capped by max_priority ({key.max_priority}), and a capped key "
        "may not hold resources that no higher priority can take back"
    )
    return (
        f"preemptible false is not allowed: {why}; leave preemptible true, or ask an operator "
        "to allow it (tuneyard keys update --allow-non-preemptible)"
    )


def asked_gpus(spec: dict[str, Any]) -> int:
    return Ask.of_spec(spec).gpus
