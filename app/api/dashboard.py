"""The web dashboard and the API docs, served from files in app/static: no build, no CDN.

The pages are static shells; all their data comes from /v1 with the user's API key, so the
shells themselves need none. Swagger UI, ReDoc and uPlot are vendored under
app/static/vendor (see its README for versions and licences).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

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


@router.get(DOCS_URL)
def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=root + (request.app.openapi_url or "/openapi.json"),
        title=f"{request.app.title} - Swagger UI",
        oauth2_redirect_url=root + OAUTH2_REDIRECT_URL,
        swagger_js_url=f"{root}{_VENDOR}/swagger-ui-dist/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{_VENDOR}/swagger-ui-dist/swagger-ui.css",
        swagger_favicon_url=f"{root}{_VENDOR}/swagger-ui-dist/favicon-32x32.png",
    )


@router.get(OAUTH2_REDIRECT_URL)
def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


# ReDoc's bundle shows its maker's logo from cdn.redoc.ly; the page's own policy keeps the
# browser from asking (the page works without it, as on a network without internet).
_REDOC_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
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
