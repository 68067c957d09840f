"""A run's lifecycle: every status change tuneyard makes, by name, behind one guard.

The transition table below is the only guard: `_move` is the one writer of `Run.status`
and refuses whatever the table does not allow. The named transitions say why a run moves
(claimed by a dispatcher, started, lost and queued again as a new attempt, settled,
cancelled, resumed), and the two `apply_*` functions turn what the worker and Ray report
into those transitions. Callers hold the run's row (or, for `claim`, its compare-and-set)
in their transaction and do any Ray calls outside it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.errors import Conflict, InvalidTransition
from app.logs import redact
from app.services import run_result
from app.services.rules.webhook_rules import WebhookConfig
from app.services.webhooks import enqueue_webhooks
from app.storage.models import Event, Run, utcnow
from contract.callbacks import EventType, FailureCode
from contract.statuses import RESUMABLE_STATUSES, RunStatus

log = logging.getLogger("tuneyard")

Q, S, R, C = RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.CANCELLING
P = RunStatus.PREEMPTING
OK, FAILED, CANCELLED = RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED

_ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    Q: frozenset({S, FAILED, CANCELLED}),
    # starting → queued: Ray accepted nothing (unreachable), or the attempt was lost.
    # A fast job can finish before the dispatcher sees it running, hence starting → terminal.
    S: frozenset({Q, R, P, C, OK, FAILED}),
    R: frozenset({Q, P, C, OK, FAILED}),  # → queued: Ray lost the job, a new attempt
    # → queued: it stopped at a checkpoint (a new attempt resumes from it); → succeeded: it
    # trained its last step first; → failed: an error of the training's own.
    P: frozenset({Q, C, OK, FAILED}),
    C: frozenset({CANCELLED, FAILED, OK}),
    # Terminal states never change, except that resume starts a new attempt.
    FAILED: frozenset({Q}),
    CANCELLED: frozenset({Q}),
    OK: frozenset(),
}


def can_transition(current: RunStatus, new: RunStatus) -> bool:
    return new in _ALLOWED[current]


def record_event(
    session: Session,
    run: Run,
    *,
    type: str,
    message: str,
    status: str | None = None,
    phase: str | None = None,
    duration_seconds: float | None = None,
) -> Event:
    """The run's history, as users read it: secrets taken out, and the same event
    happening again in a row (a dispatcher retrying while Ray is away, a worker repeating
    itself) counted on the latest row, `repeats`, instead of adding one row per time."""
    message = redact(message)
    same = (run.attempt, type, status, message, phase, duration_seconds)
    latest = _latest_event(session, run.id)
    if (
        latest is not None
        and (
            latest.attempt,
            latest.type,
            latest.status,
            latest.message,
            latest.phase,
            latest.duration_seconds,
        )
        == same
    ):
        latest.repeats = (latest.repeats or 1) + 1
        return latest
    event = Event(
        run_id=run.id,
        attempt=run.attempt,
        type=type,
        status=status,
        message=message,
        repeats=1,
        phase=phase,
        duration_seconds=duration_seconds,
    )
    session.add(event)
    return event


def _latest_event(session: Session, run_id: str) -> Event | None:
    # The session autoflushes first, so an event added earlier in this transaction counts.
    return session.scalar(
        select(Event).where(Event.run_id == run_id).order_by(Event.id.desc()).limit(1)
    )


@dataclass(frozen=True, slots=True)
class Failure:
    code: FailureCode
    message: str


def _move(
    session: Session,
    run: Run,
    new: RunStatus,
    *,
    message: str = "",
    failure: Failure | None = None,
    new_attempt: bool = False,
    only_from: RunStatus | None = None,
    hooks: WebhookConfig | None = None,
) -> bool:
    """The one writer of `run.status`; refuses what the table does not allow. `hooks`: the
    service's webhook settings, which every end of a run needs (its subscribers are told).

    `only_from`: a compare-and-set, for a move two service replicas may race for (a claim):
    the row moves only if it is still `only_from` at this attempt, whatever this session
    read before; False when another transaction moved it first."""
    current = only_from or run.run_status
    if current == new and not new_attempt:
        return True
    if not can_transition(current, new):
        raise InvalidTransition(f"run {run.id} is {current}; it cannot become {new}")
    assert hooks is not None or not new.is_terminal(), "an end is told to its subscribers"
    if only_from is not None:
        swapped = session.execute(
            update(Run)
            .where(Run.id == run.id, Run.status == only_from, Run.attempt == run.attempt)
            .values(status=new)
            .execution_options(synchronize_session=False)
        )
        if swapped.rowcount != 1:  # type: ignore[attr-defined]
            return False
    now = utcnow()
    run.status = new
    if new_attempt:
        # The old attempt's outcome is history now; the new one queues from now.
        run.attempt += 1
        run.queued_at = now
        run.finished_at = None
        run.error_code = None
        run.error_message = None
        run.ray_submission_id = None
        run.callback_token_hash = None
        run.attempt_started_at = None
    if new_attempt or new.is_terminal() or new == RunStatus.STARTING:
        # A preemption asked of the attempt that ended is over with it; a preempted run
        # reads as one until it is claimed again (app/services/queue.py).
        run.preempt_requested_at = None
        run.preempt_reason = None
    if new != RunStatus.QUEUED:
        run.queue_reason = None
    if new == RunStatus.RUNNING:
        _started(run, now)
    if new == RunStatus.SUCCEEDED:
        run_result.record_success(run)
    if new.is_terminal():
        run.finished_at = now
        run.callback_token_hash = None  # a finished run's worker has nothing more to say
    if failure is not None:
        run.error_code = failure.code
        # Shown to users: Ray's and the worker's messages may quote a credential.
        run.error_message = redact(failure.message)
    text = message or (failure.message if failure else "")
    record_event(session, run, type=EventType.STATUS, status=new, message=text)
    if hooks is not None and new.is_terminal():
        # In this transaction: a change rolled back notifies nobody.
        enqueue_webhooks(session, run, f"run.{new.value}", hooks=hooks)
    log.info("%s -> %s %s", current, new, text, extra={"run_id": run.id})
    return True


def _started(run: Run, now: datetime) -> None:
    run.attempt_started_at = run.attempt_started_at or now
    if run.started_at is None:
        run.started_at = now


# -- the named transitions ----------------------------------------------------------------


def enqueue(session: Session, run: Run) -> None:
    """A new run entered the queue: its row was just added as `queued`, and `queued_at`
    defaults to the time of that insert."""
    record_event(
        session, run, type=EventType.STATUS, status=RunStatus.QUEUED, message="run created"
    )


def claim(session: Session, run_id: str, *, token_hash: str) -> Run | None:
    """queued → starting for one dispatcher only: a compare-and-set on the status, so two
    service replicas never both submit a run. None when a peer took it (or it was cancelled)."""
    run = session.get(Run, run_id, populate_existing=True)
    if run is None or run.run_status != RunStatus.QUEUED:
        return None
    submission_id = f"{run.id}-{run.attempt}"
    if not _move(
        session,
        run,
        RunStatus.STARTING,
        only_from=RunStatus.QUEUED,
        message=f"submitting Ray job {submission_id}",
    ):
        return None
    run.ray_submission_id = submission_id
    run.callback_token_hash = token_hash
    return run


# Why a run waits while the cluster does not answer.
RAY_AWAY = "waiting for the Ray cluster, which does not answer now; the service retries"


def unclaim(session: Session, run: Run, *, reason: str) -> None:
    """starting → queued, same attempt, same place in the queue: Ray accepted nothing.

    The claim is taken back with its "submitting" event, so that a dispatcher retrying
    while Ray is away adds one event per try, which `record_event` counts on one row,
    instead of a "submitting" and a "will retry" each time (233 rows in an hour).

    The attempt's token stays good: a submit that timed out may still have reached Ray,
    and that job's worker reports with it (`start` takes a queued run through starting).
    """
    claimed = _latest_event(session, run.id)
    if claimed is not None and (claimed.attempt, claimed.type, claimed.status) == (
        run.attempt,
        "status",
        RunStatus.STARTING,
    ):
        if (claimed.repeats or 1) > 1:
            claimed.repeats -= 1
        else:
            session.delete(claimed)
    _move(session, run, RunStatus.QUEUED, message=reason)
    # What its owner reads until a pass that reaches Ray says otherwise; the event keeps
    # Ray's own words (its address among them, which is the operator's).
    run.queue_reason = RAY_AWAY


def start(session: Session, run: Run, *, message: str = "") -> None:
    """The worker is running. It may report before the dispatcher committed `starting`, and
    after a preemption was asked of it (it stays preempting, started)."""
    if run.run_status == RunStatus.QUEUED:
        _move(session, run, RunStatus.STARTING, message="job accepted by Ray")
    if run.run_status == RunStatus.PREEMPTING:
        _started(run, utcnow())
        return
    _move(session, run, RunStatus.RUNNING, message=message)


def attempts_remain(run: Run) -> bool:
    """Whether the service may start another attempt after Ray lost this one."""
    return run.resubmits < run.definition.fault_tolerance.max_resubmits


# How the reason of an attempt lost under the run begins (see `_loss_behind_attempt`).
_LOST = "lost: "


def requeue_or_fail(session: Session, run: Run, *, reason: str, hooks: WebhookConfig) -> None:
    """The attempt was lost under the run (the head restarted, a node died): a new attempt
    that resumes from the latest checkpoint, while fault_tolerance.max_resubmits allows."""
    if not attempts_remain(run):
        settle(
            session,
            run,
            RunStatus.FAILED,
            failure=Failure(
                FailureCode.LOST, f"{reason}; no attempts remain (fault_tolerance.max_resubmits)"
            ),
            hooks=hooks,
        )
        return
    if run.run_status == RunStatus.STARTING:
        # starting → queued alone would mean "Ray accepted nothing"; this attempt did run.
        _move(session, run, RunStatus.RUNNING, message="the worker had started")
    run.resubmits += 1
    _move(
        session,
        run,
        RunStatus.QUEUED,
        new_attempt=True,
        message=f"{reason}; attempt {run.attempt + 1} resumes from the latest checkpoint",
    )


def _loss_behind_attempt(session: Session, run: Run) -> str | None:
    """Why `requeue_or_fail` started the run's current attempt, if it did."""
    queued = session.scalars(
        select(Event.message)
        .where(
            Event.run_id == run.id, Event.type == EventType.STATUS, Event.status == RunStatus.QUEUED
        )
        .order_by(Event.id.desc())
        .limit(1)
    ).first()
    if queued is None or not queued.startswith(_LOST):
        return None
    return queued.split(f"; attempt {run.attempt} resumes", 1)[0]


def settle(
    session: Session,
    run: Run,
    outcome: RunStatus,
    *,
    message: str = "",
    failure: Failure | None = None,
    hooks: WebhookConfig,
) -> None:
    """The run ends: succeeded, failed or cancelled. A run already ended stays as it is."""
    assert outcome.is_terminal()
    if not run.run_status.is_terminal():
        _move(session, run, outcome, message=message, failure=failure, hooks=hooks)


def request_cancel(session: Session, run: Run, *, hooks: WebhookConfig) -> str | None:
    """Queued → cancelled at once; live → cancelling, then cancelled once Ray confirms the
    stop (the reconciler watches). Repeating a cancel is harmless. Returns the Ray job the
    caller should stop once this is committed, if any."""
    status = run.run_status
    if status in (RunStatus.CANCELLING, RunStatus.CANCELLED):
        return None
    if status.is_terminal():
        raise Conflict(f"run {run.id} is {status}; only a queued or live run can be cancelled")
    if status == RunStatus.QUEUED:
        _move(session, run, RunStatus.CANCELLED, message="cancelled before it started", hooks=hooks)
        return None
    _move(session, run, RunStatus.CANCELLING, message="cancel requested")
    return run.ray_submission_id


def request_preemption(session: Session, run: Run, *, reason: str) -> None:
    """Ask a live run's attempt to save a checkpoint at the step it is on and stop. Its
    worker reads this (GET /v1/internal/runs/{id}/control); the run is queued again when
    the worker says it stopped or its job ends (`requeue_preempted`)."""
    if run.run_status not in (RunStatus.STARTING, RunStatus.RUNNING):
        return
    run.preempt_requested_at = utcnow()
    run.preempt_reason = reason
    _move(
        session,
        run,
        RunStatus.PREEMPTING,
        message=f"preemption requested: {reason}; the attempt saves a checkpoint and stops",
    )


def preempting(run: Run) -> bool:
    return run.run_status == RunStatus.PREEMPTING


def requeue_preempted(session: Session, run: Run, *, how: str) -> None:
    """A preempted attempt stopped: back to the queue as a new attempt that resumes from
    its latest checkpoint, the one taken as it stopped. A preemption is the scheduler's
    doing, not a failure, so no failure budget counts it (`resubmits` stays)."""
    reason = run.preempt_reason or "the scheduler needed its resources"
    asked = run.preempt_requested_at or utcnow()
    step = run.step
    record_event(
        session, run, type=EventType.PREEMPTED, message=f"preempted at step {step}: {reason}"
    )
    _move(
        session,
        run,
        RunStatus.QUEUED,
        new_attempt=True,
        message=f"preempted ({how}); attempt {run.attempt + 1} resumes from the checkpoint "
        f"at step {step}",
    )
    run.queue_reason = preempted_reason(step, reason)
    # Kept while it waits (until a dispatcher claims it): the scheduler reads it as "was
    # preempted", for its reasons and because the old job may still hold what it is
    # releasing (app/services/queue.py).
    run.preempt_requested_at, run.preempt_reason = asked, reason


def preempted_reason(step: int, why: str) -> str:
    """A preempted run's queue reason until it starts again: why it was stopped, then why
    it waits."""
    return f"preempted (resumes from step {step}): {why}"


def resume(session: Session, run: Run) -> None:
    """A failed or cancelled run starts a new attempt under the same Ray Train storage name,
    so Ray Train picks up its latest checkpoint and the step count continues. It joins the
    back of the queue, and its budget of automatic resubmits starts anew."""
    status = run.run_status
    if status not in RESUMABLE_STATUSES:
        raise Conflict(f"run {run.id} is {status}; only a failed or cancelled run can be resumed")
    run.resubmits = 0
    _move(
        session,
        run,
        RunStatus.QUEUED,
        new_attempt=True,
        message=f"resumed by request: attempt {run.attempt + 1}",
    )


# -- what the worker and Ray report ---------------------------------------------------------


def apply_worker_status(
    session: Session,
    run: Run,
    status: RunStatus,
    *,
    message: str = "",
    failure: Failure | None = None,
    hooks: WebhookConfig,
) -> None:
    """A status the attempt's worker posted."""
    current = run.run_status
    if status == RunStatus.RUNNING:
        if current != RunStatus.CANCELLING:  # a late "running" must not undo a cancel request
            start(session, run, message=message)
        return
    if status == RunStatus.FAILED and current == RunStatus.CANCELLING:
        # Stopping a job makes its workers fail. The user asked for a cancel, and the run
        # becomes `cancelled` once Ray confirms the job has stopped (the reconciler's call).
        record_event(
            session,
            run,
            type=EventType.MESSAGE,
            message=f"the worker stopped: {failure.message if failure else ''}",
        )
        return
    if (
        status == RunStatus.FAILED
        and failure is not None
        and failure.code == FailureCode.UNPLACEABLE
    ):
        failure = _unplaceable(session, run, failure.message)
    if (
        status == RunStatus.FAILED
        and preempting(run)
        and (failure is None or failure.code != FailureCode.TRAINING_ERROR)
    ):
        # Stopped for the scheduler (its grace ran out and the job was stopped), or the
        # cluster failed under it on its way out: either way it goes back to the queue from
        # its latest checkpoint. An error of the training code's own is the run's failure,
        # preemption or not: it would fail the next attempt too.
        requeue_preempted(
            session, run, how=f"the attempt ended: {failure.message if failure else 'failed'}"
        )
        return
    if (
        status == RunStatus.FAILED
        and failure is not None
        and failure.code == FailureCode.CLUSTER_ERROR
    ):
        # Ray failed under the run (the head or a node went away), not the training.
        requeue_or_fail(
            session,
            run,
            reason=f"{_LOST}the cluster failed under attempt {run.attempt} ({failure.message})",
            hooks=hooks,
        )
        return
    _move(session, run, status, message=message, failure=failure, hooks=hooks)


def _unplaceable(session: Session, run: Run, message: str) -> Failure:
    """Why the run cannot be placed. An attempt started because the last one was lost (a
    node died) that finds no room: the loss is why, and the user must read it in the error."""
    if (lost := _loss_behind_attempt(session, run)) is not None:
        message = f"{lost}; then attempt {run.attempt}: {message}"
    return Failure(FailureCode.UNPLACEABLE, message)


def fail_unplaceable(session: Session, run: Run, *, message: str, hooks: WebhookConfig) -> None:
    """A queued run the cluster's nodes can no longer ever hold (a node left a cluster that
    does not autoscale): it fails now, as validation would refuse it, rather than waiting
    for room that will not come. A resume once nodes are back goes on from its checkpoint."""
    settle(session, run, RunStatus.FAILED, failure=_unplaceable(session, run, message), hooks=hooks)


class RayVerdict(enum.Enum):
    """What the dispatcher must do with Ray after `apply_ray_state` is committed."""

    NOTHING = "nothing"
    STOP_JOB = "stop_job"  # a cancelled run's job still runs: ask Ray again
    RESUBMIT = "resubmit"  # Ray never received a starting run's job


def apply_ray_state(
    session: Session,
    run: Run,
    ray_status: str | None,
    *,
    ray_message: str = "",
    job_failure: str = "",
    submit_grace_over: bool = False,
    preemption_grace_over: bool = False,
    hooks: WebhookConfig,
) -> RayVerdict:
    """Settle what callbacks missed, from Ray's view of the run's job (`ray_status` is
    Ray's JobStatus, None when Ray has never heard of the job)."""
    cancelling = run.run_status == RunStatus.CANCELLING
    trained_out = run.total_steps is not None and run.step >= run.total_steps
    if preempting(run) and ray_status == "SUCCEEDED" and trained_out:
        # It trained its last step (never preempted: a run there simply finishes) and
        # exported; its own "succeeded" was lost.
        settle(
            session, run, RunStatus.SUCCEEDED, message="settled from Ray's job status", hooks=hooks
        )
        return RayVerdict.NOTHING
    if preempting(run) and ray_status in (None, "FAILED", "STOPPED", "SUCCEEDED"):
        # The job ended while asked to stop; the worker's own word was lost, or it never
        # got to say it. (A run that trained its last step first said "succeeded".)
        requeue_preempted(session, run, how=f"its Ray job is {ray_status or 'gone'}")
        return RayVerdict.NOTHING
    if ray_status is None:
        if run.run_status == RunStatus.STARTING:
            # Never submitted (the service died before submitting), or not yet.
            return RayVerdict.RESUBMIT if submit_grace_over else RayVerdict.NOTHING
        if cancelling:
            settle(session, run, RunStatus.CANCELLED, message="the Ray job is gone", hooks=hooks)
        else:
            requeue_or_fail(
                session,
                run,
                reason=f"{_LOST}Ray no longer knows job {run.ray_submission_id} "
                "(the head restarted?)",
                hooks=hooks,
            )
    elif ray_status == "FAILED":
        if cancelling:
            settle(session, run, RunStatus.CANCELLED, message="the Ray job ended", hooks=hooks)
        else:
            settle(
                session,
                run,
                RunStatus.FAILED,
                failure=Failure(FailureCode.JOB_FAILED, job_failure),
                hooks=hooks,
            )
    elif ray_status == "STOPPED":
        if cancelling:
            settle(session, run, RunStatus.CANCELLED, message="Ray stopped the job", hooks=hooks)
        else:
            failure = Failure(FailureCode.STOPPED, f"the Ray job was stopped: {ray_message}")
            settle(session, run, RunStatus.FAILED, failure=failure, hooks=hooks)
    elif ray_status == "SUCCEEDED" and cancelling and run.preempt_requested_at is not None:
        # Cancelled while a preemption was asked: the entry point exits 0 once the attempt
        # has saved its checkpoint and stopped, untrained to the end.
        settle(
            session,
            run,
            RunStatus.CANCELLED,
            message="the attempt stopped at a checkpoint",
            hooks=hooks,
        )
    elif ray_status == "SUCCEEDED":
        # The entry point exits 0 only after training and export finished, or (handled
        # above) after a preempted attempt stopped.
        settle(
            session, run, RunStatus.SUCCEEDED, message="settled from Ray's job status", hooks=hooks
        )
    elif cancelling:
        return RayVerdict.STOP_JOB
    elif preempting(run) and preemption_grace_over:
        record_event(
            session,
            run,
            type=EventType.MESSAGE,
            message="the attempt did not stop within the preemption grace period "
            "(TUNEYARD_PREEMPTION_GRACE_S): stopping its Ray job; it resumes from its latest "
            "checkpoint",
        )
        return RayVerdict.STOP_JOB
    return RayVerdict.NOTHING
