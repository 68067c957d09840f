"""The one shape every error response has, written down so the OpenAPI document shows it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Problem(BaseModel):
    """One broken rule: the dotted name of the field it is about and the rule in words."""

    field: str = Field(examples=["deepspeed.zero_stage"])
    message: str = Field(examples=["offload_params needs zero_stage 3, got 2"])


class ErrorResponse(BaseModel):
    """`{"error": ..., "detail": ...}`: a stable code to branch on and what went wrong.

    `detail` is a list of problems for a 422 and a sentence for every other status.
    """

    error: str = Field(examples=["not_found"], description="A stable, machine-readable code.")
    detail: list[Problem] | str = Field(examples=["run run_0123 not found"])


def error_responses(
    descriptions: dict[int, str],
    *,
    non_json_route: bool = False,
    model: Any = ErrorResponse,
) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for the given statuses, each documented with `ErrorResponse`
    (or `model`, a model or a union of them: OpenAI's routes answer in OpenAI's error shape,
    the routes both clients call in either).

    FastAPI files a response `model` under the route's own media type; a route that answers
    in plain text still answers errors in JSON, so it refers to the schema by name instead
    (registered by the routes that name the model).
    """
    responses: dict[int | str, dict[str, Any]] = {}
    for code, description in descriptions.items():
        response: dict[str, Any] = {"description": description}
        if non_json_route:
            response["content"] = {"application/json": {"schema": {"$ref": _ERROR_RESPONSE_REF}}}
        else:
            response["model"] = model
        if code == 401:
            response["headers"] = _CHALLENGE_HEADER
        responses[code] = response
    return responses


_ERROR_RESPONSE_REF = f"#/components/schemas/{ErrorResponse.__name__}"

# Every 401 carries it (app/api/error_handlers.py), as RFC 9110 §11.6.1 requires.
_CHALLENGE_HEADER = {
    "WWW-Authenticate": {
        "description": 'The scheme to authenticate with: `Bearer realm="tuneyard"`, with '
        '`error="invalid_token"` when the token sent was refused (RFC 6750 §3).',
        "schema": {"type": "string"},
    }
}
