"""A run's statuses, and which of them are final or resumable: declared here once, for the
service, the command line and the dashboard (served to it as a module, app/api/dashboard.py).
Which may follow which, and every change, is app/services/lifecycle.py."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    # Asked by the scheduler to save a checkpoint and stop, to make room for a run of higher
    # priority; queued again (a new attempt that resumes) once it has.
    PREEMPTING = "preempting"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})
# A run that ended without finishing may go on from its latest checkpoint (POST …/resume).
RESUMABLE_STATUSES = frozenset({RunStatus.FAILED, RunStatus.CANCELLED})
