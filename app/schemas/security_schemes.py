"""The credentials the OpenAPI document declares, so that /docs can send them ("Authorize").

They only declare: with `auto_error=False` they read the header and never refuse a request.
Checking the API key (app/api/deps.py) and the run token (app/services/callbacks.py) stays
where it is.
"""

from __future__ import annotations

from fastapi.security import HTTPBearer

api_key = HTTPBearer(
    scheme_name="APIKey",
    description="An API key from `tuneyard keys create`, sent as `Authorization: Bearer <key>`.",
    auto_error=False,
)

run_token = HTTPBearer(
    scheme_name="RunToken",
    description="The run's own token, which the worker finds in its environment.",
    auto_error=False,
)
