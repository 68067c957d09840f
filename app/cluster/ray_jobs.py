"""Ray's job API as tuneyard needs it, with Ray's failures sorted into what they mean."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

# Re-exported: the one redaction rule lives with the service's other outgoing text.
from app.logs import redact, redact_url

log = logging.getLogger("tuneyard")

# More nodes than any cluster tuneyard serves; the state API returns 100 by default.
NODE_LIMIT = 10_000


class _RedactedError(Exception):
    """Its message becomes events, run errors and API answers: no credential in it (Ray's
    errors quote the address, which may carry a token as `http://user:token@host`)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class RayUnavailable(_RedactedError):
    """Ray could not be reached: try again later, the request itself may be fine."""


class UsageNotReported(RayUnavailable):
    """Ray answers, but its monitor has reported no node's usage yet (a head's first seconds,
    or a monitor that is failing)."""


class RayRejected(_RedactedError):
    """Ray answered and refused the job: trying again will not help."""


@dataclass(frozen=True, slots=True)
class JobState:
    status: str  # Ray's JobStatus value: PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A submitted job as Ray lists it."""

    submission_id: str
    status: str
    # When it was submitted, in seconds since the epoch by the head's clock (None: unknown).
    submitted_at: float | None
    metadata: dict[str, str]


class RayJobs:
    def __init__(self, address: str) -> None:
        self.address = address
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def display_address(self) -> str:
        """The address as it may be shown: without the credentials it may carry."""
        return redact_url(self.address) or ""

    def _get_client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        with self._lock:
            if self._client is None:
                try:
                    self._client = JobSubmissionClient(self.address)
                except Exception as exc:  # Ray raises bare ConnectionError/RuntimeError here
                    where = self.display_address
                    raise RayUnavailable(f"cannot reach Ray at {where}: {exc}") from exc
            return self._client

    def retarget(self, address: str) -> None:
        """Point at another Ray (the embedded head was restarted on new ports)."""
        with self._lock:
            self.address = address
            self._client = None

    def _drop_client(self) -> None:
        with self._lock:
            self._client = None

    def reachable(self) -> bool:
        try:
            self._get_client().get_version()
            return True
        except Exception:
            self._drop_client()
            return False

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Submit once; a submission id Ray already holds counts as submitted. `metadata`
        is kept with Ray's record of the job (`list_jobs`)."""
        client = self._get_client()
        try:
            client.submit_job(
                entrypoint=entrypoint,
                submission_id=submission_id,
                runtime_env=runtime_env,
                metadata=metadata,
                # The driver only coordinates; the training workers ask for the CPUs.
                entrypoint_num_cpus=0,
            )
        except Exception as exc:
            text = str(exc)
            if "already exists" in text:
                log.info("job %s already submitted; treating as submitted", submission_id)
                return
            if _is_connection_error(exc):
                self._drop_client()
                raise RayUnavailable(f"cannot reach Ray at {self.display_address}: {text}") from exc
            raise RayRejected(text) from exc

    def state(self, submission_id: str) -> JobState | None:
        """Ray's view of a job, or None when Ray has never heard of it."""
        client = self._get_client()
        try:
            info = client.get_job_info(submission_id)
        except Exception as exc:
            if "does not exist" in str(exc) or "404" in str(exc):
                return None
            self._drop_client()
            raise RayUnavailable(f"cannot read job {submission_id} from Ray: {exc}") from exc
        return JobState(status=str(info.status.value), message=info.message or "")

    def list_jobs(self) -> list[JobRecord]:
        """Every submitted job Ray keeps a record of (drivers without a submission id, such
        as a `ray.init` script's, are left out)."""
        client = self._get_client()
        try:
            details = client.list_jobs()
        except Exception as exc:
            self._drop_client()
            raise RayUnavailable(f"cannot list the jobs of {self.display_address}: {exc}") from exc
        return [
            JobRecord(
                submission_id=job.submission_id,
                status=str(job.status.value),
                submitted_at=job.start_time / 1000 if job.start_time else None,
                metadata=dict(job.metadata or {}),
            )
            for job in details
            if job.submission_id
        ]

    def stop(self, submission_id: str) -> None:
        try:
            self._get_client().stop_job(submission_id)
        except Exception as exc:
            if "does not exist" in str(exc):
                return
            self._drop_client()
            raise RayUnavailable(f"cannot stop job {submission_id}: {exc}") from exc

    def delete(self, submission_id: str) -> None:
        """Forget a finished job's record (Ray keeps it until the head restarts otherwise;
        its log files stay on disk). Ray refuses to delete a job that is still running."""
        try:
            self._get_client().delete_job(submission_id)
        except Exception as exc:
            if "does not exist" in str(exc):
                return
            self._drop_client()
            raise RayUnavailable(f"cannot delete job {submission_id}: {exc}") from exc

    def logs(self, submission_id: str) -> str:
        try:
            return str(self._get_client().get_job_logs(submission_id))
        except Exception as exc:
            raise RayUnavailable(f"cannot read logs of {submission_id}: {exc}") from exc

    def node_resources(self, *, timeout_s: int = 5) -> list[dict[str, float]]:
        """Each alive node's total resources ({"CPU": 8.0, "GPU": 1.0, ...}), read from the
        dashboard's state API at the same address and with the same token as the job API."""
        from ray.util.state import list_nodes

        try:
            nodes = list_nodes(
                address=self.address,
                filters=[("state", "=", "ALIVE")],
                limit=NODE_LIMIT,
                timeout=timeout_s,
                raise_on_missing_output=False,
            )
        except Exception as exc:  # ServerUnavailable, RayStateApiException, auth, timeouts
            raise RayUnavailable(f"cannot read the nodes of {self.display_address}: {exc}") from exc
        return [
            {name: float(amount) for name, amount in (node.resources_total or {}).items()}
            for node in nodes
        ]

    def free_resources(self, *, timeout_s: int = 5) -> list[dict[str, float]]:
        """Each alive node's free resources now (app/cluster/usage.py says how Ray tells)."""
        from app.cluster.usage import free_by_node

        try:
            # The job client's own request: the same address, token and TLS settings.
            response = self._get_client()._do_request(
                "GET", "/nodes?view=summary", timeout=timeout_s
            )
            response.raise_for_status()
            data = response.json()["data"]
        except RayUnavailable:
            raise
        except Exception as exc:
            raise RayUnavailable(
                f"cannot read the free resources of {self.display_address}: {exc}"
            ) from exc
        try:
            return free_by_node(data)
        except ValueError as exc:
            raise UsageNotReported(
                f"{self.display_address} reports no node's usage yet: {exc}"
            ) from exc


def try_stop(jobs: RayJobs, submission_id: str) -> None:
    """Stop a job, or leave it to the reconciler, which asks Ray again on its next pass."""
    try:
        jobs.stop(submission_id)
    except RayUnavailable as exc:
        log.warning("could not reach Ray to stop job %s yet: %s", submission_id, exc)


# What Ray's dashboard answers (a 500) while the head's job agent has not started, or has
# not registered yet: a head still starting, or busy. Ray's own words ask for a retry
# (ray/dashboard/modules/job/job_head.py); a run must not fail for it.
_NOT_YET = ("No available agent to submit job", "Failed to get head node agent")


def _is_connection_error(exc: Exception) -> bool:
    import requests

    text = str(exc)
    return isinstance(exc, requests.ConnectionError | ConnectionError | TimeoutError) or any(
        words in text for words in ("Failed to connect", "Connection refused", *_NOT_YET)
    )
