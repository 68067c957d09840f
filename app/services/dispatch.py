"""The dispatcher: submits queued runs to Ray and settles what callbacks missed.

Store before you launch: a run is claimed (`queued → starting`, a compare-and-set, so two
service replicas never both take it) and committed before `submit_job` is called with a
submission id derived from run id and attempt. If the service dies in between, the
reconciler finds a `starting` run Ray has never heard of and submits it again under the
same id, so there is never a second job.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.background import TickLoop
from app.cluster.ray_jobs import (
    JobState,
    RayJobs,
    RayRejected,
    RayUnavailable,
    UsageNotReported,
    redact,
    try_stop,
)
from app.cluster.runtime_env import ENTRYPOINT, job_runtime_env
from app.logs import RepeatedWarning, run_log
from app.metrics import ServiceMetrics
from app.schemas.run_view import as_utc
from app.security import hash_secret, new_secret
from app.services import lifecycle, queue
from app.services.lifecycle import Failure, RayVerdict
from app.services.placement import ClusterView, placement_problems
from app.services.queue import LIVE
from app.services.rules.tracking_rules import tracking_job_env
from app.settings import Settings
from app.storage.db import transaction
from app.storage.models import Run, utcnow
from contract.callbacks import EventType, FailureCode
from contract.job_env import (
    CALLBACK_URL_ENV,
    TOKEN_ENV,
)
from contract.run_request import ResourcesSpec, RunSpec
from contract.statuses import RunStatus

log = logging.getLogger("tuneyard")

# A `starting` run younger than this may still be in its dispatcher's hands.
SUBMIT_GRACE = timedelta(seconds=30)
MAX_RAY_BACKOFF_S = 30.0
# How long the dispatcher rests after a scheduling pass on SQLite, as a multiple of the
# pass, and at most: passes then hold the write lock at most a fifth of the time (see
# dispatch_queued_runs).
SCHEDULE_REST_FACTOR = 4.0
MAX_SCHEDULE_REST_S = 1.0
# How long the queue waits for a Ray that answers but has reported no node's usage yet.
USAGE_WAIT_S = 30.0
LOG_TAIL_LINES = 20
_OBJECT_ID = re.compile(r" at 0x[0-9a-fA-F]+")


def _without_object_ids(text: str) -> str:
    """requests' errors name objects by address ("<HTTPConnection object at 0x7f…>"), which
    would make each retry's event differ from the last and defeat their coalescing."""
    return _OBJECT_ID.sub("", text)


def build_runtime_env(run: Run, *, token: str, settings: Settings) -> dict[str, Any]:
    spec = RunSpec.for_attempt(
        run.spec,
        run_id=run.id,
        attempt=run.attempt,
        storage_path=settings.storage.root,
    )
    return job_runtime_env(
        spec,
        settings=settings,
        env={
            TOKEN_ENV: token,
            CALLBACK_URL_ENV: settings.resolved_callback_url,
            # A run's trackers, and only a run's: a profile's job logs to none.
            **tracking_job_env(spec, config=settings.tracking_config()),
        },
    )


class Dispatcher(TickLoop):
    name = "tuneyard-dispatcher"

    def __init__(
        self,
        *,
        settings: Settings,
        session_factory: sessionmaker[Session],
        jobs: RayJobs,
        read_session_factory: sessionmaker[Session] | None = None,
        revive_ray: Callable[[], None] | None = None,
        metrics: ServiceMetrics | None = None,
        cluster: ClusterView | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.session_factory = session_factory
        # For reads that lead to no write (the service's reader engine, on SQLite: no write
        # lock). The reconciler reads the live runs on every tick, and every create wakes it.
        self.read_session_factory = read_session_factory or session_factory
        self.jobs = jobs
        # The cluster's nodes (validation's view): a queued run they can never hold fails.
        self.cluster = cluster
        # When a queued run was first seen that the nodes can never hold (`_never_fits`).
        self._clock = clock
        self._unplaceable_since: dict[str, float] = {}
        self._unplaceable_last_pass: set[str] = set()
        self._usage_unknown_since: float | None = None
        # Embedded mode: restart the local head if it died (the service owns it).
        self.revive_ray = revive_ray
        # While Ray is unreachable, queued runs wait this long between tries (doubling).
        self._ray_backoff_s = 0.0
        self._ray_retry_at = 0.0
        self._schedule_rest_until = 0.0
        self._sqlite = session_factory.kw["bind"].dialect.name == "sqlite"
        self._ray_unavailable = RepeatedWarning(log)
        # Every end of a run this dispatcher settles is told to its subscribers.
        self.hooks = settings.webhook_config()
        super().__init__(interval_s=settings.dispatch_interval_s)

    def rest_s(self) -> float:
        return max(0.0, self._schedule_rest_until - time.monotonic())

    def tick(self) -> None:
        started = time.perf_counter()
        self.reconcile_live_runs()
        if self.metrics is not None:
            self.metrics.reconcile_duration.observe(time.perf_counter() - started)
        self.dispatch_queued_runs()

    # -- dispatch ---------------------------------------------------------------------

    def dispatch_queued_runs(self) -> int:
        """Start what the scheduler admits (app/services/scheduling.py), record why the rest
        wait, and ask for the preemptions it decides; then submit the admitted to Ray."""
        if time.monotonic() < self._ray_retry_at or not self._any_queued():
            return 0
        try:
            free_nodes, reported = self._free_nodes()
        except UsageNotReported:
            return 0  # a head starting: its nodes are known within seconds
        started = time.perf_counter()
        with transaction(self.session_factory) as session:
            admitted = queue.schedule(
                session,
                settings=self.settings,
                hooks=self.hooks,
                free_nodes=free_nodes,
                free_reported=reported,
                now=utcnow(),
                never_fits=self._never_fits(),
            )
            claimed = [
                claim
                for run_id, queued_at in admitted
                if (claim := self._claim(session, run_id, queued_at)) is not None
            ]
        took = time.perf_counter() - started
        if self._sqlite:
            # A pass holds SQLite's write lock, the whole service's, while it ranks the
            # queue, and every create wakes one. Resting SCHEDULE_REST_FACTOR times as long
            # after each keeps a burst of creates over a long queue from holding it most of
            # the time, and costs nothing while passes are short. Capped: a pass that
            # waited long for the lock itself must not put the next off for longer.
            rest = min(SCHEDULE_REST_FACTOR * took, MAX_SCHEDULE_REST_S)
            self._schedule_rest_until = time.monotonic() + rest
        if self.metrics is not None:
            self.metrics.schedule_duration.observe(took)
        dispatched = 0
        for run_id, sid, runtime_env, queued_at in claimed:
            if time.monotonic() < self._ray_retry_at:
                # Ray went away during this pass: the rest go back to the queue as they were.
                with self._locked(run_id) as (session, run):
                    if run is not None and run.run_status == RunStatus.STARTING:
                        lifecycle.unclaim(session, run, reason="Ray unavailable, will retry")
                continue
            if not self._submit(run_id, sid, runtime_env):
                continue
            dispatched += 1
            if self.metrics is not None:
                waited = utcnow() - (as_utc(queued_at) or utcnow())
                self.metrics.dispatch_latency.observe(max(waited.total_seconds(), 0.0))
        return dispatched

    def _any_queued(self) -> bool:
        """Whether a run waits. A pass over an empty queue decides nothing (queue.schedule
        returns at once), so an idle service does not ask Ray's dashboard for its nodes'
        usage every tick, nor take the write lock a pass takes."""
        with self.read_session_factory() as session:
            waiting = select(Run.id).where(Run.status == RunStatus.QUEUED).limit(1)
            return session.scalar(waiting) is not None

    def _free_nodes(self) -> tuple[list[dict[str, float]] | None, bool]:
        """Each node's free resources and whether Ray reported them; (None, False) when the
        cluster is not to be judged: it autoscales (a run held back in tuneyard's queue
        would never ask Ray for the nodes it needs), or it cannot be read at all (submitting
        finds out, and backs off). Without Ray's report of what is taken (its monitor has
        not reported yet, as in a head's first seconds), the nodes' totals stand in, less
        what tuneyard's own live runs hold."""
        if self.settings.cluster_autoscales:
            return None, False
        try:
            free = self.jobs.free_resources()
        except RayUnavailable as exc:
            totals = self.cluster.nodes() if self.cluster is not None else None
            if totals:
                log.warning("dispatch: %s; judging by the nodes' totals", exc)
                return [dict(n) for n in totals], False
            if isinstance(exc, UsageNotReported):
                # Ray answers and knows no node yet: a head starting. Hold the queue a while
                # rather than start a burst of runs unjudged; a monitor that never reports
                # (failing) must not hold it for good.
                since = self._usage_unknown_since = self._usage_unknown_since or time.monotonic()
                if time.monotonic() - since < USAGE_WAIT_S:
                    raise
            log.warning("dispatch: %s; not judging the cluster", exc)
            return None, False
        self._usage_unknown_since = None
        return free, True

    def _never_fits(self) -> Callable[[str, dict[str, Any]], queue.NeverFits | None] | None:
        """Whether the cluster's nodes can never hold a queued run: said at once, and failed
        once that has held for TUNEYARD_UNPLACEABLE_GRACE_S (a node lost for good, not one
        restarting or rejoining after a head restart; a GPU run accepted before the nodes
        were known); None for a cluster not judged (it autoscales, or is not known)."""
        # Forget the runs that fit again, or left the queue, in the last pass.
        self._unplaceable_since = {
            run_id: since
            for run_id, since in self._unplaceable_since.items()
            if run_id in self._unplaceable_last_pass
        }
        self._unplaceable_last_pass = seen = set()
        nodes = self.cluster.nodes() if self.cluster is not None else None
        if nodes is None:
            return None
        now = self._clock()
        grace = self.settings.unplaceable_grace_s

        def never_fits(run_id: str, spec: dict[str, Any]) -> queue.NeverFits | None:
            problems = placement_problems(
                ResourcesSpec.model_validate(spec["resources"]),
                nodes,
                tensor_parallel_size=spec["deepspeed"]["tensor_parallel_size"],
            )
            if not problems:
                return None
            why = "; ".join(p["message"] for p in problems)
            seen.add(run_id)
            since = self._unplaceable_since.setdefault(run_id, now)
            if now - since < grace:
                return queue.NeverFits(
                    f"no node can hold it: {why} (it fails if none that can joins within "
                    f"{grace:g} s, TUNEYARD_UNPLACEABLE_GRACE_S)",
                    fail=False,
                )
            del self._unplaceable_since[run_id]
            return queue.NeverFits(why, fail=True)

        return never_fits

    def _claim(
        self, session: Session, run_id: str, queued_at: Any
    ) -> tuple[str, str, dict[str, Any], Any] | None:
        token = new_secret("rt")
        run = lifecycle.claim(session, run_id, token_hash=hash_secret(token))
        if run is None:
            return None
        runtime_env = build_runtime_env(run, token=token, settings=self.settings)
        return run_id, run.ray_submission_id or "", runtime_env, queued_at

    def _submit(self, run_id: str, sid: str, runtime_env: dict[str, Any]) -> bool:
        run_logger = run_log(log, run_id)
        started = time.perf_counter()
        try:
            self.jobs.submit(submission_id=sid, entrypoint=ENTRYPOINT, runtime_env=runtime_env)
        except RayUnavailable as exc:
            if self.revive_ray is not None:
                self.revive_ray()
            self._ray_backoff_s = min(max(self._ray_backoff_s * 2, 1.0), MAX_RAY_BACKOFF_S)
            self._ray_retry_at = time.monotonic() + self._ray_backoff_s
            run_logger.warning(
                "Ray unavailable, back to the queue for %.0fs: %s", self._ray_backoff_s, exc
            )
            with self._locked(run_id) as (session, run):
                if run is not None and run.run_status == RunStatus.STARTING:
                    reason = f"Ray unavailable, will retry: {_without_object_ids(str(exc))}"
                    lifecycle.unclaim(session, run, reason=reason)
            return False
        except RayRejected as exc:
            run_logger.error("Ray rejected the job: %s", exc)
            with self._locked(run_id) as (session, run):
                if run is not None:
                    failure = Failure(FailureCode.RAY_REJECTED, f"Ray rejected the job: {exc}")
                    lifecycle.settle(
                        session, run, RunStatus.FAILED, failure=failure, hooks=self.hooks
                    )
            return False
        if self.metrics is not None:
            self.metrics.ray_submit_duration.observe(time.perf_counter() - started)
        run_logger.info("submitted Ray job %s", sid)
        self._ray_backoff_s = 0.0
        return True

    @contextlib.contextmanager
    def _locked(self, run_id: str) -> Iterator[tuple[Session, Run | None]]:
        """The run's row, locked for one transaction (None when it is gone)."""
        with transaction(self.session_factory) as session:
            yield session, session.get(Run, run_id, with_for_update=True)

    # -- reconciliation ---------------------------------------------------------------

    def reconcile_live_runs(self) -> None:
        """Compare every live run with Ray's view of its job and settle the differences."""
        # Each run is read again, locked, before anything is written (`_reconcile`).
        with self.read_session_factory() as session:
            live = list(session.scalars(select(Run).where(Run.status.in_(LIVE))))
        for run in live:
            if not run.ray_submission_id:
                continue
            try:
                state = self.jobs.state(run.ray_submission_id)
            except RayUnavailable as exc:
                self._ray_unavailable.warning("reconcile: Ray unavailable: %s", exc)
                if self.revive_ray is not None:
                    self.revive_ray()
                return
            self._ray_unavailable.clear()
            self._reconcile(run, state)

    def _reconcile(self, seen: Run, state: JobState | None) -> None:
        # Ray's calls happen outside the run's transaction: the log tail before it, a stop
        # or a resubmission after it.
        job_failure = ""
        if (
            state is not None
            and state.status == "FAILED"
            and seen.run_status != RunStatus.CANCELLING
        ):
            job_failure = self._failure_message(seen, state)
        updated = as_utc(seen.updated_at)
        asked = as_utc(seen.preempt_requested_at)
        grace = timedelta(seconds=self.settings.preemption_grace_s)
        with self._locked(seen.id) as (session, run):
            # Ray's state is the job's that was read: a run preempted (or resumed) since then
            # is on a new attempt, whose fate the old job does not decide.
            if (
                run is None
                or run.run_status.is_terminal()
                or run.ray_submission_id != seen.ray_submission_id
            ):
                return
            verdict = lifecycle.apply_ray_state(
                session,
                run,
                state.status if state else None,
                ray_message=state.message if state else "",
                job_failure=job_failure,
                submit_grace_over=bool(updated and utcnow() - updated > SUBMIT_GRACE),
                preemption_grace_over=bool(asked and utcnow() - asked > grace),
                hooks=self.hooks,
            )
        if verdict is RayVerdict.STOP_JOB:
            try_stop(self.jobs, seen.ray_submission_id or "")
        elif verdict is RayVerdict.RESUBMIT:
            self._resubmit(seen.id)

    def _failure_message(self, run: Run, state: JobState) -> str:
        message = f"the Ray job failed: {state.message}"
        try:
            tail = redact(
                "\n".join(
                    self.jobs.logs(run.ray_submission_id or "").splitlines()[-LOG_TAIL_LINES:]
                )
            )
        except RayUnavailable:
            return message
        return f"{message}\nlast log lines:\n{tail}" if tail else message

    def _resubmit(self, run_id: str) -> None:
        """A `starting` run Ray never received (the service died before submitting)."""
        token = new_secret("rt")
        with transaction(self.session_factory) as session:
            run = session.get(Run, run_id, with_for_update=True)
            if run is None or run.status != RunStatus.STARTING:
                return
            run.callback_token_hash = hash_secret(token)
            lifecycle.record_event(
                session,
                run,
                type=EventType.MESSAGE,
                message="Ray never received the job; resubmitting",
            )
            runtime_env = build_runtime_env(run, token=token, settings=self.settings)
            sid = run.ray_submission_id
        self._submit(run_id, sid, runtime_env)  # type: ignore[arg-type]
