"""Profiles: a valid request's first steps, measured on the cluster before the run is paid
for (`POST /v1/runs/validate` with `profile: true`).

The service submits a Ray job (`profile-<random>`) with the runtime env of a run's own job
(app/cluster/runtime_env.py `job_runtime_env`) and `python -m worker.profile` as its entry
point, which builds the training as a run does and times a few steps under Ray Train with
the run's resources. Rank 0 writes what it measured to `profiles/<id>.json` in storage, or the job's
driver writes why it failed there. The service waits for the job without holding a thread
(each look at Ray is one short trip to a worker thread), reads the JSON, then leaves the
cluster as it was: the JSON, Ray Train's folder for the profile and Ray's record of the job
are deleted. A profile that runs past TUNEYARD_PROFILE_TIMEOUT_S, or whose client went
away, is stopped first. Nothing is stored in the database.

A profile holds the cluster as a run would, without waiting in the queue, so it is counted:
the key's limits hold for it (app/services/queue.py `check_profile`), each key runs one at
a time and a process TUNEYARD_MAX_CONCURRENT_PROFILES in all (`ProfileSlots`). What a
service that stopped mid-profile (a crash) left, `ProfileReaper` stops and deletes: at
start-up, and every few minutes after.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.to_thread

from app.background import TickLoop
from app.cluster.ray_jobs import JobRecord, JobState, RayJobs, RayRejected, RayUnavailable, redact
from app.cluster.runtime_env import job_runtime_env
from app.errors import TooManyRequests
from app.schemas.profile import ProfileError, ProfileView, WorkerProfile, warmup_steps
from app.settings import Settings
from contract.job_env import PLACEMENT_TIMEOUT_ENV, PROFILE_ENV
from contract.run_request import ResourcesSpec, RunSpec
from contract.storage import Storage, StorageError

log = logging.getLogger("tuneyard")

PROFILES_DIRNAME = "profiles"
ENTRYPOINT = "python -m worker.profile"
TERMINAL_JOB_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# How often the wait looks at the job (and at the client).
POLL_INTERVAL_S = 0.5
# A stopped job's driver and workers take a moment to go; its folders are deleted after.
STOP_WAIT_S = 30.0
LOG_TAIL_LINES = 20
# Ray's job manager looks at a job's supervisor this often (see `_forget`).
RAY_MONITOR_PERIOD_S = 1.0
FORGET_WAIT_S = 15.0
# How often the reaper looks for what services that stopped mid-profile left.
REAP_INTERVAL_S = 300.0
# A profile job's Ray metadata: the storage root of the service that submitted it (which
# service's it is) and that service process's name (`instance_name`).
STORAGE_KEY = "tuneyard_profile_storage"
INSTANCE_KEY = "tuneyard_profile_instance"


def new_profile_id() -> str:
    # Never a run's id (`run_…`): the reconciler and Ray Train's folders of runs stay apart.
    return f"profile-{secrets.token_hex(8)}"


@dataclass(frozen=True, slots=True)
class ProfileJob:
    id: str  # the Ray submission id, and Ray Train's run name
    result: str  # the storage location of the JSON the job writes


def instance_name(settings: Settings) -> str:
    """This service process as its profile jobs name it: its host and port. The same service
    started again (after a crash) has the same name, so it knows the jobs its last run left;
    another replica, on another host or port, has another."""
    return f"{socket.gethostname()}:{settings.port}"


def job_metadata(settings: Settings) -> dict[str, str]:
    return {STORAGE_KEY: settings.storage.root, INSTANCE_KEY: instance_name(settings)}


class ProfileSlots:
    """The profiles this process runs: one at a time per API key, `total` in all. Another
    profile is refused (429) rather than queued: the request would wait minutes holding its
    connection, and the client may ask again."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._lock = threading.Lock()
        self._owners: dict[str, str] = {}  # profile id -> its key

    @contextmanager
    def hold(self, owner_id: str) -> Iterator[str]:
        """A slot for `owner_id`'s profile while the block runs: the profile's id."""
        with self._lock:
            if owner_id in self._owners.values():
                raise TooManyRequests(
                    "this API key has a profile running already, and a key runs one at a "
                    "time: profile again once it has answered"
                )
            if len(self._owners) >= self.total:
                raise TooManyRequests(
                    f"this service runs {len(self._owners)} profiles already, its most at "
                    "once (TUNEYARD_MAX_CONCURRENT_PROFILES): profile again once one has "
                    "answered"
                )
            profile_id = new_profile_id()
            self._owners[profile_id] = owner_id
        try:
            yield profile_id
        finally:
            with self._lock:
                del self._owners[profile_id]

    def running(self) -> set[str]:
        with self._lock:
            return set(self._owners)


async def profile_request(
    spec_fields: dict[str, Any],
    *,
    steps: int,
    total_steps: int | None,
    settings: Settings,
    jobs: RayJobs | None,
    disconnected: Callable[[], Awaitable[bool]],
    job_id: str | None = None,
) -> ProfileView:
    """Measure `spec_fields` (a checked request's spec) on the cluster: `steps` steps.
    `disconnected` tells whether the client is gone, which stops the profile. `job_id`: the
    profile's id, as `ProfileSlots.hold` gave it (None: a new one)."""
    shown = ProfileView(steps=steps, warmup_steps=warmup_steps(steps), total_steps=total_steps)
    resources = ResourcesSpec.model_validate(spec_fields["resources"])
    if jobs is None:
        return _failed(shown, "ray_unavailable", "this service is not attached to a Ray cluster")
    job_id = job_id or new_profile_id()
    job = ProfileJob(id=job_id, result=result_location(settings.storage, job_id))
    runtime_env = profile_runtime_env(spec_fields, job=job, steps=steps, settings=settings)
    try:
        await anyio.to_thread.run_sync(
            partial(
                jobs.submit,
                submission_id=job.id,
                entrypoint=ENTRYPOINT,
                runtime_env=runtime_env,
                metadata=job_metadata(settings),
            )
        )
    except (RayUnavailable, RayRejected) as exc:
        return _failed(shown, "ray_unavailable", f"the profile could not be submitted: {exc}")
    log.info("profile %s submitted", job.id)
    ended: JobState | str = "cancelled"
    try:
        ended = await _wait(jobs, job.id, settings.profile_timeout_s, disconnected)
    finally:
        # Whatever ended the wait (the server shutting down too), the job goes and its files
        # with it, before the answer.
        with anyio.CancelScope(shield=True):
            document, failure = await anyio.to_thread.run_sync(
                partial(_finish, jobs, settings.storage, job, ended)
            )
    if isinstance(ended, str):
        reason = (
            f"the profile did not finish within {settings.profile_timeout_s:g} s "
            "(TUNEYARD_PROFILE_TIMEOUT_S); its job was stopped"
            if ended == "timeout"
            else "the client went away; the profile's job was stopped"
        )
        return _failed(shown, f"profile_{ended}", reason)
    if document is None:
        return _failed(shown, "profile_failed", failure or "the profile wrote no result")
    return measured_view(
        document, shown=shown, total_steps=total_steps, resources=resources, settings=settings
    )


def result_location(storage: Storage, job_id: str) -> str:
    return storage.join(PROFILES_DIRNAME, f"{job_id}.json")


def profile_runtime_env(
    spec_fields: dict[str, Any], *, job: ProfileJob, steps: int, settings: Settings
) -> dict[str, Any]:
    spec = RunSpec.for_attempt(
        spec_fields, run_id=job.id, attempt=1, storage_path=settings.storage.root
    )
    options = {"steps": steps, "warmup_steps": warmup_steps(steps), "result": job.result}
    return job_runtime_env(
        spec,
        settings=settings,
        env={
            PROFILE_ENV: json.dumps(options),
            # Ray Train's wait for the workers ends before the profile's own does.
            PLACEMENT_TIMEOUT_ENV: str(
                min(settings.placement_timeout_s, settings.profile_timeout_s)
            ),
        },
    )


async def _wait(
    jobs: RayJobs,
    job_id: str,
    timeout_s: float,
    disconnected: Callable[[], Awaitable[bool]],
) -> JobState | str:
    """The job's terminal state, or why the wait ended without one: "timeout" or
    "disconnected". Ray unreachable for a moment is waited out, within the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await disconnected():
            return "disconnected"
        try:
            state = await anyio.to_thread.run_sync(jobs.state, job_id)
        except RayUnavailable as exc:
            log.warning("profile %s: %s", job_id, exc)
            state = None
        if state is not None and state.status in TERMINAL_JOB_STATES:
            return state
        await anyio.sleep(POLL_INTERVAL_S)
    return "timeout"


def _finish(
    jobs: RayJobs, storage: Storage, job: ProfileJob, ended: JobState | str
) -> tuple[dict[str, Any] | None, str | None]:
    """Stop the job if it still runs, read what it wrote and delete every trace of it: the
    JSON it wrote (or None) and, for a job that failed without one, Ray's account of why."""
    state = ended if isinstance(ended, JobState) else _stop(jobs, job.id)
    document = _read_json(storage, job.result)
    failure = None
    if document is None and state is not None and state.status != "SUCCEEDED":
        failure = _failure_message(jobs, job.id, state)
    _delete_files(storage, job.id)
    if state is not None and state.status in TERMINAL_JOB_STATES:
        try:
            _forget(jobs, job.id)
        except RayUnavailable as exc:
            log.warning("profile %s: could not delete its Ray job: %s", job.id, exc)
    else:
        log.warning("profile %s: its Ray job did not stop within %.0f s", job.id, STOP_WAIT_S)
    return document, failure


def _forget(jobs: RayJobs, job_id: str) -> None:
    """Delete Ray's record of the ended job, until it stays deleted. Ray's job manager
    watches each job's supervisor every second (JOB_MONITOR_LOOP_PERIOD_S) until it sees it
    exit; if the record is gone by then, it writes a FAILED one anew (job_manager.py,
    `_monitor_job_internal`). So the record must be seen absent past one more of its
    looks before the job counts as forgotten."""
    deadline = time.monotonic() + FORGET_WAIT_S
    while True:
        jobs.delete(job_id)
        absent_since = time.monotonic()
        while jobs.state(job_id) is None:
            if time.monotonic() - absent_since > RAY_MONITOR_PERIOD_S * 2:
                return
            time.sleep(POLL_INTERVAL_S)
        if time.monotonic() > deadline:
            log.warning("profile %s: Ray keeps a record of its job", job_id)
            return


def _stop(jobs: RayJobs, job_id: str) -> JobState | None:
    """Stop the job and wait for Ray to say it ended (None if it did not in time)."""
    deadline = time.monotonic() + STOP_WAIT_S
    try:
        jobs.stop(job_id)
        while time.monotonic() < deadline:
            state = jobs.state(job_id)
            if state is None or state.status in TERMINAL_JOB_STATES:
                return state
            time.sleep(POLL_INTERVAL_S)
    except RayUnavailable as exc:
        log.warning("profile %s: could not stop its Ray job: %s", job_id, exc)
    return None


def _read_json(storage: Storage, location: str) -> dict[str, Any] | None:
    try:
        if not storage.exists(location):
            return None
        document = json.loads(storage.read_bytes(location))
    except (StorageError, ValueError) as exc:
        log.warning("profile result %s unreadable: %s", location, exc)
        return None
    return document if isinstance(document, dict) else None


def _failure_message(jobs: RayJobs, job_id: str, state: JobState) -> str:
    message = f"the profile's Ray job {state.status.lower()}: {state.message}"
    try:
        tail = "\n".join(jobs.logs(job_id).splitlines()[-LOG_TAIL_LINES:])
    except RayUnavailable:
        return message
    return f"{message}\nlast log lines:\n{redact(tail)}" if tail else message


def _failed(shown: ProfileView, code: str, message: str) -> ProfileView:
    return shown.model_copy(update={"error": ProfileError(code=code, message=message)})


# --- what a service that stopped mid-profile left ------------------------------------------


class ProfileReaper(TickLoop):
    """Stops the profile jobs no service waits for any more and deletes them and their files,
    and deletes profile files whose job Ray no longer knows: what a service that stopped
    mid-profile (a crash, a kill) left. At start-up, then every REAP_INTERVAL_S.

    A profile job is this service's when its metadata names this service's storage. No
    service waits for it when a process of this one's name (`instance_name`: this service
    before it was started again) submitted it before this process started, or when it was
    submitted longer ago than any service waits for one (TUNEYARD_PROFILE_TIMEOUT_S, then
    its stop and clean-up). Another replica's profiles under way are left alone, and so are
    this process's own (`slots`)."""

    name = "tuneyard-profile-reaper"

    def __init__(self, *, settings: Settings, jobs: RayJobs, slots: ProfileSlots) -> None:
        super().__init__(interval_s=REAP_INTERVAL_S)
        self.settings = settings
        self.jobs = jobs
        self.slots = slots
        self.instance = instance_name(settings)
        self.started_at = time.time()

    def tick(self) -> list[str]:
        """Reap once: the ids of the profiles whose jobs or files went."""
        # Storage first: a file listed then was written by a job Ray had a record of then,
        # which the list below shows unless the job's service is done with it.
        stored = self._stored_ids()
        try:
            records = [r for r in self.jobs.list_jobs() if r.submission_id.startswith("profile-")]
        except RayUnavailable as exc:
            log.warning("profiles not reaped: %s", exc)
            return []
        running = self.slots.running()
        reaped = []
        for record in records:
            if record.submission_id not in running and self._orphaned(record):
                self._reap(record)
                reaped.append(record.submission_id)
        known = {r.submission_id for r in records} | running
        for profile_id in sorted(stored - known):
            log.info("profile %s: deleting what its job left in storage", profile_id)
            _delete_files(self.settings.storage, profile_id)
            reaped.append(profile_id)
        return reaped

    def _orphaned(self, record: JobRecord) -> bool:
        if record.metadata.get(STORAGE_KEY) != self.settings.storage.root:
            return False  # another service's, or not a tuneyard profile
        if record.submitted_at is None:
            return False
        if (
            record.metadata.get(INSTANCE_KEY) == self.instance
            and record.submitted_at < self.started_at
        ):
            return True
        waited_at_most = self.settings.profile_timeout_s + STOP_WAIT_S + FORGET_WAIT_S
        return time.time() - record.submitted_at > waited_at_most

    def _reap(self, record: JobRecord) -> None:
        job_id = record.submission_id
        log.warning("profile %s: no service waits for it any more; stopping it", job_id)
        state: JobState | None = JobState(record.status, "")
        try:
            if record.status not in TERMINAL_JOB_STATES:
                state = _stop(self.jobs, job_id)
            if state is not None and state.status in TERMINAL_JOB_STATES:
                _forget(self.jobs, job_id)  # else the next pass, once it has stopped
        except RayUnavailable as exc:
            log.warning("profile %s: %s", job_id, exc)
        _delete_files(self.settings.storage, job_id)

    def _stored_ids(self) -> set[str]:
        """The profiles that have a result or a Ray Train folder in storage."""
        storage = self.settings.storage
        try:
            results = storage.files(storage.join(PROFILES_DIRNAME))
            folders = storage.folders(storage.root)
        except StorageError as exc:
            log.warning("profile files not reaped: %s", exc)
            return set()
        ids = {f.name.removesuffix(".json") for f in results if "/" not in f.name}
        ids |= set(folders)
        return {i for i in ids if i.startswith("profile-")}


def _delete_files(storage: Storage, job_id: str) -> None:
    for location in (result_location(storage, job_id), storage.join(job_id)):
        try:
            storage.delete(location)
        except StorageError as exc:
            log.warning("profile %s: could not delete %s: %s", job_id, location, exc)


# --- what the numbers mean for the whole run ---------------------------------------------


def gpus_of(resources: ResourcesSpec) -> int:
    """The GPUs a run holds while it trains: what a GPU-hour price is charged for."""
    if not resources.use_gpu:
        return 0
    return resources.num_workers * (resources.gpus_per_worker or 1)


def estimated_total_seconds(
    *, startup_seconds: float, step_time_seconds: float, total_steps: int | None
) -> float | None:
    """The run's wall time: its start-up, then every step at the measured pace."""
    if total_steps is None:
        return None
    return startup_seconds + step_time_seconds * total_steps


def estimated_cost(
    *, gpu_hour_price: float | None, gpus: int, total_seconds: float | None
) -> float | None:
    """GPU-hours at the configured price. A CPU-only run holds no GPU, so it costs 0 at any
    GPU price (not null: the service has a price, and the run's share of it is nothing)."""
    if gpu_hour_price is None or total_seconds is None:
        return None
    return gpu_hour_price * gpus * total_seconds / 3600


def measured_view(
    document: dict[str, Any],
    *,
    shown: ProfileView,
    total_steps: int | None,
    resources: ResourcesSpec,
    settings: Settings,
) -> ProfileView:
    """The worker's JSON (worker/profile.py) with the whole run's time and cost added."""
    error = document.get("error")
    if isinstance(error, dict):
        return _failed(shown, str(error.get("code")), str(error.get("message")))
    step_time = float(document["step_time_seconds"])
    startup = float(document["startup_seconds"])
    total = estimated_total_seconds(
        startup_seconds=startup, step_time_seconds=step_time, total_steps=total_steps
    )
    gpus = gpus_of(resources)
    cost = estimated_cost(gpu_hour_price=settings.gpu_hour_price, gpus=gpus, total_seconds=total)
    return shown.model_copy(
        update={
            "steps_measured": int(document["steps_measured"]),
            "step_time_seconds": step_time,
            "tokens_per_second": document.get("tokens_per_second"),
            "samples_per_second": document.get("samples_per_second"),
            "startup_seconds": startup,
            "workers": [WorkerProfile.model_validate(w) for w in document["workers"]],
            "estimated_total_seconds": total,
            "gpus": gpus,
            "estimated_cost": cost,
            "currency": settings.gpu_hour_currency if cost is not None else None,
        }
    )
