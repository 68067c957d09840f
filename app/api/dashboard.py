"""The web dashboard and the API docs, served from files in app/static: no build, no CDN.

The pages are static shells; all their data comes from /v1 with the user's API key, so the
shells themselves need none. Swagger UI, ReDoc and uPlot are vendored under
app/static/vendor (see its README for versions and licences).
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from contract.statuses import RESUMABLE_STATUSES, TERMINAL_STATUSES, RunStatus

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_URL = "/static"
DOCS_URL = "/docs"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
REDOC_URL = "/redoc"

_VENDOR = f"{STATIC_URL}/vendor"

router = APIRouter(include_in_schema=False)


def static_files() -> StaticFiles:
    """What `app.mount(STATIC_URL, ...)` serves: the pages' scripts, styles and vendored
    libraries."""
    return StaticFiles(directory=STATIC_DIR)


def _page(name: str) -> FileResponse:
    return FileResponse(STATIC_DIR / name, media_type="text/html")


# Served beside the pages' scripts (this router comes before the static mount), which import
# it as `./statuses.js`: the statuses they branch on are contract/statuses.py's, not copies.
STATUSES_MODULE = f"{STATIC_URL}/js/statuses.js"


@router.get(STATUSES_MODULE)
def statuses_module() -> Response:
    lines = [
        # Every status in the lifecycle's order: the list page's filter offers these.
        f"export const ALL = {json.dumps([str(s) for s in RunStatus])};",
        *(
            f"export const {name} = new Set({json.dumps(sorted(statuses))});"
            for name, statuses in (
                ("TERMINAL", TERMINAL_STATUSES),
                ("RESUMABLE", RESUMABLE_STATUSES),
            )
        ),
    ]
    return Response("\n".join(lines) + "\n", media_type="text/javascript")


@router.get("/")
def runs_page() -> FileResponse:
    return _page("index.html")


@router.get("/runs/{run_id}")
def run_page(run_id: str) -> FileResponse:
    return _page("run.html")  # the script reads the id from the address


@router.get("/compare")
def compare_page() -> FileResponse:
    return _page("compare.html")


@router.get("/submit")
def submit_page() -> FileResponse:
    return _page("submit.html")


# FastAPI's Swagger UI pages start it with an inline script; these load theirs from
# app/static/js instead, so that the pages' policy (app/api/security_headers.py) allows no
# inline script at all. The addresses the script needs are data attributes.
_SWAGGER_UI = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>{title}</title>
  <link rel="stylesheet" href="{vendor}/swagger-ui-dist/swagger-ui.css">
  <link rel="icon" href="{vendor}/swagger-ui-dist/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui" data-openapi-url="{openapi_url}" data-oauth2-redirect-url="{redirect}"></div>
  <script src="{vendor}/swagger-ui-dist/swagger-ui-bundle.js"></script>
  <script src="{static}/js/swagger-init.js"></script>
</body>
</html>
"""
_OAUTH2_REDIRECT = """<!doctype html>
<html lang="en-US">
<head><title>Swagger UI: OAuth2 Redirect</title></head>
<body><script src="{static}/js/swagger-oauth2-redirect.js"></script></body>
</html>
"""


@router.get(DOCS_URL)
def swagger_ui(request: Request) -> HTMLResponse:
    root = escape(request.scope.get("root_path", ""))
    page = _SWAGGER_UI.format(
        title=escape(f"{request.app.title} - Swagger UI"),
        openapi_url=root + escape(request.app.openapi_url or "/openapi.json"),
        redirect=root + OAUTH2_REDIRECT_URL,
        vendor=root + _VENDOR,
        static=root + STATIC_URL,
    )
    return HTMLResponse(page)


@router.get(OAUTH2_REDIRECT_URL)
def swagger_ui_redirect(request: Request) -> HTMLResponse:
    root = escape(request.scope.get("root_path", ""))
    return HTMLResponse(_OAUTH2_REDIRECT.format(static=root + STATIC_URL))


# ReDoc's policy: the pages' (app/api/security_headers.py), but ReDoc injects its styles
# (styled-components) and searches in a worker it makes from a blob. Its bundle shows its
# maker's logo from cdn.redoc.ly; the policy keeps the browser from asking (the page works
# without it, as on a network without internet).
_REDOC_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)


@router.get(REDOC_URL)
def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    page = get_redoc_html(
        openapi_url=root + (request.app.openapi_url or "/openapi.json"),
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{_VENDOR}/redoc/redoc.standalone.js",
        redoc_favicon_url=f"{root}{_VENDOR}/swagger-ui-dist/favicon-32x32.png",
        with_google_fonts=False,  # no request leaves for a CDN
    )
    page.headers["Content-Security-Policy"] = _REDOC_POLICY
    return page
