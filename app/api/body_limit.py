"""Refusing an upload body past its limit while it arrives, not after it was read whole."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Message, Receive

from app.api.deps import app_state
from app.errors import PayloadTooLarge

# The multipart framing and the form fields around the file.
MULTIPART_ALLOWANCE = 64 * 1024


class _BodyTooLarge(Exception):
    pass


class _CountingReceive:
    """`receive`, counting body bytes; past `limit` it raises instead of reading on."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self.limit = limit
        self.received = 0
        self.exceeded = False

    async def __call__(self) -> Message:
        if self.exceeded:
            raise _BodyTooLarge
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.exceeded = True
                raise _BodyTooLarge
        return message


class _LimitedRoute(APIRoute):
    """A route whose body may be at most `limit(request)` bytes.

    FastAPI reads and parses a body (and spools a form's files to disk) before the route
    function runs: a check there comes after the whole body was read. This one wraps that
    reading. A declared Content-Length over the limit is refused before a byte is read; a
    body without one (chunked) is counted as it arrives and abandoned at the first chunk past
    the limit, its rest never read."""

    def limit(self, request: Request) -> tuple[int, str]:
        """The limit in bytes, and what a refusal says."""
        raise NotImplementedError

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited_handler(request: Request) -> Response:
            limit, message = self.limit(request)
            too_large = PayloadTooLarge(message)
            declared = _content_length(request)
            if declared is not None and declared > limit:
                raise too_large
            receive = _CountingReceive(request.receive, limit)
            try:
                response = await handler(Request(request.scope, receive))
            except Exception as exc:
                # FastAPI reports a failed body read as a 400 "error parsing the body".
                if receive.exceeded:
                    raise too_large from exc
                raise
            if receive.exceeded:
                raise too_large
            return response

        return limited_handler


def _content_length(request: Request) -> int | None:
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):
        return None


class UploadLimitedRoute(_LimitedRoute):
    """An upload: at most TUNEYARD_MAX_UPLOAD_BYTES plus the multipart framing."""

    def limit(self, request: Request) -> tuple[int, str]:
        max_upload_bytes = app_state(request).settings.max_upload_bytes
        return max_upload_bytes + MULTIPART_ALLOWANCE, (
            f"the upload is larger than the {max_upload_bytes}-byte limit "
            "(TUNEYARD_MAX_UPLOAD_BYTES)"
        )


# A grader route's body: the largest model_sample (1,000,000 characters, up to 6 bytes
# each as JSON escapes them), a grader and an item. The service grades it in its own
# process, so its size is bounded before it is parsed.
GRADER_BODY_BYTES = 8 * 1024 * 1024


class GraderBodyLimitedRoute(_LimitedRoute):
    def limit(self, request: Request) -> tuple[int, str]:
        return GRADER_BODY_BYTES, f"a grader request is limited to {GRADER_BODY_BYTES} bytes"
