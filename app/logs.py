"""Text that leaves the service: structured logs, and the one rule that takes secrets out.

Every record that concerns a run carries `run_id` as its own field. A record gets its run id
from `extra={"run_id": ...}` (see `run_log`) or, inside a request for `/v1/runs/{id}/…` or
`/v1/internal/runs/{id}/…`, from the request's context.

`redact` is applied wherever text leaves the service: log lines, run events and errors
(app/services/lifecycle.py), a job's log (app/services/run_logs.py), /healthz, and the
messages of Ray's errors (app/cluster/ray_jobs.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import time
from collections.abc import MutableMapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pythonjsonlogger.json import JsonFormatter
from starlette.types import ASGIApp, Receive, Scope, Send

current_run_id: ContextVar[str | None] = ContextVar("tuneyard_run_id", default=None)

_RUN_PATH = re.compile(r"^/v1/(?:internal/)?runs/(run_[A-Za-z0-9]+)")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RunIdFilter(logging.Filter):
    """Fills `record.run_id` from the request context when the call did not pass one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_id", None) is None:
            record.run_id = current_run_id.get()
        return True


class TextFormatter(logging.Formatter):
    """Human-readable, with `run_id=` appended so grep finds every line of a run."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        run_id = getattr(record, "run_id", None)
        # The whole line, traceback included: an exception's text may quote a URL.
        return redact(f"{line} run_id={run_id}" if run_id else line)


class _RedactingJsonFormatter(JsonFormatter):
    def format(self, record: logging.LogRecord) -> str:
        # The replacements hold no quote or backslash, so the JSON stays valid.
        return redact(super().format(record))


def configure_logging(*, fmt: Literal["text", "json"], level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RunIdFilter())
    if fmt == "json":
        handler.setFormatter(
            _RedactingJsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s %(run_id)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(TextFormatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs each request's whole URL at INFO: a tenant's webhook URL, with any token in
    # its path or query, would reach the operator's logs on every delivery. Its warnings
    # stay; the deliverer logs the host of a failed delivery itself.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def run_log(logger: logging.Logger, run_id: str) -> logging.LoggerAdapter[logging.Logger]:
    """A logger whose every record carries `run_id`."""
    return _RunAdapter(logger, {"run_id": run_id})


class _RunAdapter(logging.LoggerAdapter[logging.Logger]):
    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


class RunIdMiddleware:
    """Puts the run id from the path into the logging context for the whole request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _RUN_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        token = current_run_id.set(match.group(1))
        try:
            await self.app(scope, receive, send)
        finally:
            current_run_id.reset(token)


class RepeatedWarning:
    """A warning that a loop can hit many times a second while one condition lasts (Ray
    unreachable, seen by the reconciler on every tick, and every create wakes it: about 50
    lines a second under load). Logged at once, then at most once every `every_s` seconds,
    saying how many were held back. `clear()` when the condition ends, so that the next time
    it starts is logged at once."""

    def __init__(self, logger: logging.Logger, *, every_s: float = 60.0) -> None:
        self._logger = logger
        self._every_s = every_s
        self._next_at: float | None = None
        self._held_back = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if self._next_at is not None and now < self._next_at:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} more like it in the last {self._every_s:.0f} s)"
        self._logger.warning(message, *args)
        self._next_at = now + self._every_s
        self._held_back = 0

    def clear(self) -> None:
        self._next_at = None
        self._held_back = 0


# -- redaction ------------------------------------------------------------------------------

REDACTED = "[redacted]"
# scheme://user:password@host → scheme://***@host (a Ray address with a token, a database
# URL with its password). The user is hidden too: with a token as the "user", it is the secret.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#@'\"<>]+@")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
# The secrets tuneyard itself makes (app/security.py new_secret): API keys `ty_…` and run
# callback tokens `rt_…`, 43 url-safe characters after the prefix.
_TUNEYARD_SECRET = re.compile(r"\b(?:ty|rt)_[A-Za-z0-9_-]{40,}")
# libpq's key=value form: "host=db password=s3cret".
_DSN_PASSWORD = re.compile(r"(?i)\b(password|passwd|pwd)=(?!\[redacted\])[^\s&;,'\"]+")
# Names of variables that hold credentials (HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY,
# TUNEYARD_RUN_TOKEN in a worker).
_SECRET_NAME = re.compile(r"(?i)token|secret|password|passwd|credential|(^|_)key$|api_?key")
# Shorter values are too likely to occur in ordinary text ("true", a port number).
_MIN_SECRET_LEN = 8


def redact(text: str) -> str:
    """`text` with every credential the service knows of or recognises taken out: the
    values of secret-named variables, this process's and the jobs' (TUNEYARD_JOB_ENV, the
    passed-through ones), Ray's auth token, any URL's userinfo (so TUNEYARD_DATABASE_URL's
    password and a Ray address's token, wherever they are quoted), bearer tokens,
    tuneyard's API keys and run tokens, and libpq's `password=`."""
    for secret in _known_secrets():
        text = text.replace(secret, REDACTED)
    text = _URL_USERINFO.sub(r"\1***@", text)
    text = _BEARER.sub(rf"\1{REDACTED}", text)
    text = _TUNEYARD_SECRET.sub(REDACTED, text)
    return _DSN_PASSWORD.sub(rf"\1={REDACTED}", text)


def redact_url(url: str | None) -> str | None:
    """A URL for display: `http://user:token@head:8265` → `http://***@head:8265`."""
    return None if url is None else redact(url)


def _known_secrets() -> tuple[str, ...]:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    mtime_ns = _mtime_ns(path) if path else None
    fingerprint = _environment_fingerprint()
    if fingerprint is None:
        return _collect_secrets(path, mtime_ns)
    return _cached_secrets(fingerprint, path, mtime_ns)


def _environment_fingerprint() -> int | None:
    """A hash of the environment as it is now. Redaction runs on every log line (an access
    line per request): reading the secrets out of the whole environment each time, with a
    str decode per variable, cost more than the rest of the line. CPython keeps the raw
    bytes mapping behind os.environ; hashing it is cheap, and changes with any variable.
    None elsewhere: then nothing is cached."""
    raw = getattr(os.environ, "_data", None)
    return hash(frozenset(raw.items())) if isinstance(raw, dict) else None


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@functools.lru_cache(maxsize=8)
def _cached_secrets(
    fingerprint: int, token_path: str | None, token_mtime_ns: int | None
) -> tuple[str, ...]:
    """`_collect_secrets` for one version of the environment and of Ray's token file: the
    arguments are the cache's key."""
    return _collect_secrets(token_path, token_mtime_ns)


def _collect_secrets(token_path: str | None, token_mtime_ns: int | None) -> tuple[str, ...]:
    variables = dict(os.environ)
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        variables.update(json.loads(os.environ.get("TUNEYARD_JOB_ENV") or "{}"))
    secrets = [str(v) for name, v in variables.items() if _SECRET_NAME.search(name)]
    if token_path and token_mtime_ns is not None:
        with contextlib.suppress(OSError):
            secrets.append(Path(token_path).read_text().strip())
    # Longest first: a secret that contains another is replaced whole.
    return tuple(sorted({s for s in secrets if len(s) >= _MIN_SECRET_LEN}, key=len, reverse=True))
