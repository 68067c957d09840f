"""Which requests get OpenAI's shapes, and OpenAI's error body.

The fine-tuning routes (`/v1/fine_tuning/...`) are OpenAI's alone. `/v1/files` serves
both clients: tuneyard's fields by default, OpenAI's (Unix timestamps, `purpose:
"fine-tune"`, `{"error": {...}}`) for a request from one of OpenAI's SDKs, which all send
the `X-Stainless-Lang` header, or one that says so itself with `OpenAI-Shapes: true`.
Every other route is tuneyard's alone and answers in tuneyard's shapes whatever the headers
say, as its document promises (an OpenAI SDK never calls them).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from app.schemas.errors import error_responses
from app.schemas.openai_shapes import OpenAIError

OPENAI_ROUTES = "/v1/fine_tuning"
SHARED_ROUTES = "/v1/files"
SDK_HEADER = "x-stainless-lang"
OPT_IN_HEADER = "openai-shapes"

# OpenAI's error `type` by status, as its API names them.
_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def speaks_openai(request: Request) -> bool:
    path = request.url.path
    if path.startswith(OPENAI_ROUTES):
        return True
    if path != SHARED_ROUTES and not path.startswith(SHARED_ROUTES + "/"):
        return False
    return SDK_HEADER in request.headers or request.headers.get(OPT_IN_HEADER, "").lower() == "true"


def openai_error(status_code: int, error: str, detail: object) -> tuple[int, dict[str, Any]]:
    """tuneyard's error as OpenAI's: a broken rule is a 400 whose `param` names the first
    field and whose message lists every problem; other statuses keep their code."""
    param = None
    if isinstance(detail, list):
        problems = [p for p in detail if isinstance(p, dict)]
        message = "; ".join(f"{p.get('field')}: {p.get('message')}" for p in problems)
        param = str(problems[0].get("field")) if problems else None
    else:
        message = str(detail)
    if status_code == 422:
        status_code = 400
    kind = _TYPE_OF_STATUS.get(status_code, "server_error" if status_code >= 500 else "error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": error}}
    return status_code, body


def openai_responses(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for an OpenAI route: a broken rule is a 400, never a 422 (so
    FastAPI's default 422 entry is replaced by `default`: any other error, in the same
    shape)."""
    return {
        **error_responses(descriptions, model=OpenAIError),
        "default": {"model": OpenAIError, "description": "Any other error, in the same shape"},
    }
