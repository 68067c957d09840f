"""Run status as a written-down state machine: the only place transitions are decided."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})

_ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.STARTING, RunStatus.FAILED, RunStatus.CANCELLED}),
    # A fast job can finish before the dispatcher sees it RUNNING, hence starting → terminal.
    RunStatus.STARTING: frozenset(
        {
            RunStatus.QUEUED,  # Ray accepted nothing (unreachable): try again later
            RunStatus.RUNNING,
            RunStatus.CANCELLING,
            RunStatus.SUCCEEDED,
            RunStatus.FAILED,
        }
    ),
    RunStatus.RUNNING: frozenset(
        {
            RunStatus.QUEUED,  # Ray lost the job (head restarted): a new attempt
            RunStatus.CANCELLING,
            RunStatus.SUCCEEDED,
            RunStatus.FAILED,
        }
    ),
    RunStatus.CANCELLING: frozenset({RunStatus.CANCELLED, RunStatus.FAILED, RunStatus.SUCCEEDED}),
    # Terminal states never change, except that resume starts a new attempt.
    RunStatus.FAILED: frozenset({RunStatus.QUEUED}),
    RunStatus.CANCELLED: frozenset({RunStatus.QUEUED}),
    RunStatus.SUCCEEDED: frozenset(),
}


def can_transition(current: RunStatus, new: RunStatus) -> bool:
    return new in _ALLOWED[current]
