"""One rendering for every error: `{"error": ..., "detail": ...}`, never a traceback."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import TuneyardError, problems_from_pydantic


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TuneyardError)
    async def _domain(_: Request, exc: TuneyardError) -> JSONResponse:
        return JSONResponse({"error": exc.error, "detail": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"error": "validation_error", "detail": problems_from_pydantic(exc.errors())},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            {"error": "http_error", "detail": exc.detail},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
