"""Structured logs: every record that concerns a run carries `run_id` as its own field.

A record gets its run id from `extra={"run_id": ...}` (see `run_log`) or, inside a request
for `/v1/runs/{id}/…` or `/v1/internal/runs/{id}/…`, from the request's context.
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping
from contextvars import ContextVar
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
        return f"{line} run_id={run_id}" if run_id else line


def configure_logging(*, fmt: Literal["text", "json"], level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RunIdFilter())
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s %(run_id)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(TextFormatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


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
