"""One rendering for every error: `{"error": ..., "detail": ...}`, never a traceback;
OpenAI's `{"error": {"message", "type", "param", "code"}}` for its clients
(app/api/openai_compat.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import fastapi.routing
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import get_route_path

from app.api.deps import bearer_token
from app.api.openai_compat import openai_error, speaks_openai
from app.api.security_headers import security_headers
from app.errors import TuneyardError, bearer_challenge, problems_from_pydantic
from contract.storage import StorageError

_INTERNAL_ERROR = "internal server error; the service log has the details"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TuneyardError)
    async def _domain(request: Request, exc: TuneyardError) -> JSONResponse:
        return _error(request, exc.status_code, exc.error, exc.detail)

    @app.exception_handler(StorageError)
    async def _storage(request: Request, exc: StorageError) -> JSONResponse:
        # The object store is down or refuses the service's credentials: the request may
        # work again later, and the message names the location, never a credential.
        return _error(request, 503, "storage_unavailable", str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, 422, "validation_error", problems_from_pydantic(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route whose path matched; a path
            # several routes share (GET and POST /v1/runs) answers them all.
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return _error(request, exc.status_code, "http_error", exc.detail, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this returns; the client learns nothing of it.
        # This answer is built outside the middleware, so it carries its headers itself.
        response = _error(request, 500, "internal_error", _INTERNAL_ERROR)
        response.headers.update(security_headers(response.media_type))
        return response


def _error(
    request: Request,
    status_code: int,
    error: str,
    detail: object,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    headers = dict(headers or {})
    if status_code == 401:
        # RFC 9110 §11.6.1: every 401 names the scheme the client should authenticate with.
        sent = bearer_token(request) is not None
        headers.setdefault("WWW-Authenticate", bearer_challenge(credentials_sent=sent))
    if speaks_openai(request):
        status_code, body = openai_error(status_code, error, detail)
        return JSONResponse(body, status_code=status_code, headers=headers)
    return JSONResponse(
        {"error": error, "detail": detail}, status_code=status_code, headers=headers
    )


def _allowed_methods(request: Request) -> list[str]:
    path = get_route_path(request.scope)
    methods: set[str] = set()
    for route in _flat_routes(request.app):
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= route_methods
    return sorted(methods)


def _flat_routes(app: FastAPI) -> Iterable[Any]:
    # Newer FastAPI keeps an included router as one branch of `app.routes`, and flattens the
    # branches with `iter_route_contexts`, as its own OpenAPI generator does; older versions
    # list every route in `app.routes`.
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    return flatten(app.routes) if flatten is not None else app.routes
