"""Turn a training failure into one message a user can act on."""

from __future__ import annotations

MAX_MESSAGE_CHARS = 2_000


def failure_code(exc: BaseException) -> str:
    """`cluster_error` when Ray itself failed under the run (a node or the head went away),
    which a new attempt can survive; `training_error` for everything the run's own code or
    data raised, which would fail again the same way."""
    from ray.exceptions import RayError, RayTaskError

    root = _root(_first_failure(exc))
    return (
        "cluster_error"
        if isinstance(root, RayError) and not isinstance(root, RayTaskError)
        else "training_error"
    )


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
    worker_failures = getattr(exc, "worker_failures", None)
    if worker_failures:
        rank, inner = min(worker_failures.items())
        return _truncate(f"worker rank {rank}: {_root_message(inner)}")
    controller_failure = getattr(exc, "controller_failure", None)
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
