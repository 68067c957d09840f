"""Domain errors carry their HTTP status (app/api/error_handlers.py renders them), and the
one shape of a broken rule: the field it is about and the rule in words."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.schemas.run_view import SERVER_OWNED_FIELDS


class TuneyardError(Exception):
    status_code = 500
    error = "internal_error"

    def __init__(self, detail: Any) -> None:
        super().__init__(str(detail))
        self.detail = detail


class NotFound(TuneyardError):
    status_code = 404
    error = "not_found"


class Conflict(TuneyardError):
    status_code = 409
    error = "conflict"


class InvalidTransition(Conflict):
    error = "invalid_transition"


class PayloadTooLarge(TuneyardError):
    status_code = 413
    error = "payload_too_large"


class TooManyRequests(TuneyardError):
    """A limit on how much a caller may have at once (an API key's max_queued_runs)."""

    status_code = 429
    error = "too_many_requests"


class Unauthorized(TuneyardError):
    """Both credentials tuneyard takes (API keys, run tokens) are bearer tokens; a 401 names
    the scheme in `WWW-Authenticate`, as RFC 9110 §11.6.1 requires of every 401."""

    status_code = 401
    error = "unauthorized"


# The realm names the protection space: API keys and run tokens both belong to this service.
AUTH_REALM = "tuneyard"


def bearer_challenge(*, credentials_sent: bool) -> str:
    """The `WWW-Authenticate` value of a 401 (RFC 6750 §3): a request that sent no token gets
    the bare challenge; one whose token was refused is told so with `invalid_token`."""
    challenge = f'Bearer realm="{AUTH_REALM}"'
    if credentials_sent:
        challenge += ', error="invalid_token"'
    return challenge


class ValidationFailed(TuneyardError):
    """Request-level problems found after parsing (paths, files): same shape as schema errors."""

    status_code = 422
    error = "validation_error"

    def __init__(self, problems: list[dict[str, str]]) -> None:
        super().__init__(problems)


def field_problem(field: str, message: str) -> dict[str, str]:
    return {"field": field, "message": message}


def _field_name(loc: tuple[Any, ...]) -> str:
    # Only the first part says where (body, query, ...); a body field may be named `path`.
    where = 1 if loc and loc[0] in ("body", "query", "path", "header", "cookie") else 0
    parts = [str(p) for p in loc[where:]]
    return ".".join(parts) or "body"


def problems_from_pydantic(errors: Sequence[Any]) -> list[dict[str, str]]:
    """Pydantic's errors as tuneyard's problems: the dotted field name and a plain rule."""
    problems = []
    for err in errors:
        field = _field_name(tuple(err.get("loc", ())))
        message = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            message = (
                f"{field} is set by the server and cannot be given"
                if field in SERVER_OWNED_FIELDS
                else f"unknown field {field!r}"
            )
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        problems.append(field_problem(field, message))
    return problems
