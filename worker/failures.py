"""Turn a training failure into one message a user can act on."""

from __future__ import annotations

MAX_MESSAGE_CHARS = 2_000


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
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(cause, BaseException):
            break
        exc = cause
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
