"""Turn a training failure into one message a user can act on."""

from __future__ import annotations

from contract.callbacks import FailureCode

MAX_MESSAGE_CHARS = 2_000


class TrainingCodeError(Exception):
    """A rank's own error, raised in Ray Train's controller to end the run without the
    retries meant for dead workers (worker.training.trainer.TrainingErrorStop)."""

    def __init__(self, message: str, rank: int) -> None:
        # Both in args: the error is pickled from the controller to the job's driver.
        super().__init__(message, rank)
        self.message, self.rank = message, rank

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, rank: int, error: BaseException) -> TrainingCodeError:
        return cls(f"worker rank {rank}: {_root_message(error)}", rank)


def raised_by_training_code(exc: BaseException) -> bool:
    """Whether a worker's error came from the training code, not from Ray losing it."""
    from ray.exceptions import RayError, RayTaskError
    from ray.train.v2._internal.exceptions import (
        WorkerHealthCheckFailedError,
        WorkerHealthCheckTimeoutError,
    )

    # Ray Train reports a worker whose process died (or stopped answering) as a failed
    # health check, not as the ActorDiedError underneath.
    if isinstance(exc, WorkerHealthCheckFailedError | WorkerHealthCheckTimeoutError):
        return False
    root = _root(exc)
    if isinstance(root, RayError) and not isinstance(root, RayTaskError):
        return False
    # A peer's collective failing because another rank's process died: if Ray reports it
    # before the death itself, it is still the death's, which a restart can survive.
    text = str(root)
    return not any(marker in text for marker in _PEER_LOST)


# What gloo and NCCL raise on the surviving ranks when a peer's process goes away.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "ncclRemoteError",
    "NCCL communicator was aborted",
)


def failure_code(exc: BaseException) -> FailureCode:
    """`cluster_error` when Ray itself failed under the run (a node or the head went away),
    which a new attempt can survive; `training_error` for everything the run's own code or
    data raised, which would fail again the same way; `unplaceable` when the cluster could
    not hold the run's workers, which another attempt would not change."""
    from worker.reporting.placement import placement_failure

    if placement_failure(exc) is not None:
        return FailureCode.UNPLACEABLE
    if raised_by_training_code(_first_failure(exc)):
        return FailureCode.TRAINING_ERROR
    return FailureCode.CLUSTER_ERROR


def _first_failure(exc: BaseException) -> BaseException:
    worker_failures = getattr(exc, "worker_failures", None)
    if worker_failures:
        return min(worker_failures.items())[1]
    controller_failure = getattr(exc, "controller_failure", None)
    return controller_failure if isinstance(controller_failure, BaseException) else exc


def _root(exc: BaseException) -> BaseException:
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def describe_failure(exc: BaseException) -> str:
    """The root cause's own words, not Ray's wrapping of them.

    Ray Train wraps worker exceptions (WorkerGroupError → RayTaskError → the user's error);
    the innermost one is what the user needs to read.
    """
    from worker.reporting.placement import placement_failure

    if (unplaced := placement_failure(exc)) is not None:
        return _truncate(unplaced)
    worker_failures = getattr(exc, "worker_failures", None)
    if worker_failures:
        rank, inner = min(worker_failures.items())
        return _truncate(f"worker rank {rank}: {_root_message(inner)}")
    controller_failure = getattr(exc, "controller_failure", None)
    if isinstance(controller_failure, TrainingCodeError):
        return _truncate(str(controller_failure))
    if controller_failure is not None:
        return _truncate(f"controller: {_root_message(controller_failure)}")
    return _truncate(_root_message(exc))


def _root_message(exc: BaseException) -> str:
    exc = _root(exc)
    text = str(exc).strip()
    # RayTaskError's text is a whole traceback; its last line names the real error.
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return (
        f"{type(exc).__name__}: {last}"
        if last and type(exc).__name__ not in last
        else last or type(exc).__name__
    )


def _truncate(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"
