"""A run's log text, read from Ray, with secrets taken out."""

from __future__ import annotations

from app.cluster.ray_jobs import RayJobs, RayUnavailable, redact
from app.errors import TuneyardError
from app.storage.models import Run


class RayUnreachable(TuneyardError):
    status_code = 503
    error = "ray_unavailable"


def read_logs(run: Run, *, jobs: RayJobs | None, tail: int | None) -> str:
    if not run.ray_submission_id:
        return ""
    if jobs is None:
        raise RayUnreachable("this service is not attached to Ray")
    try:
        text = jobs.logs(run.ray_submission_id)
    except RayUnavailable as exc:
        raise RayUnreachable(str(exc)) from exc
    if tail is not None:
        text = "\n".join(text.splitlines()[-tail:])
    return redact(text)
