"""Response headers that keep a browser from misreading the API's answers (OWASP API8).

Every answer is data for one client, often about one principal's runs: nothing may cache it,
sniff it into another type, or frame it. JSON answers may not load anything either. The
HTML pages (the dashboard, Swagger UI) load what they need from this service only, and run
no inline script or style: a second line of defence, should text from a run ever reach a
page as markup (they render it with `textContent`). ReDoc, which injects its styles, has a
policy of its own (app/api/dashboard.py).
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_ALWAYS = {
    # A proxy or browser cache would keep one principal's runs where another may read them.
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # X-Frame-Options for browsers that predate CSP's frame-ancestors.
    "X-Frame-Options": "DENY",
}
_CSP_DATA = "default-src 'none'; frame-ancestors 'none'"
# Scripts and styles are files in app/static; Swagger UI's stylesheet draws its icons as
# data: images. No plugins, no <base> pointing elsewhere, no form posted elsewhere.
CSP_PAGES = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)


def security_headers(content_type: str | None) -> dict[str, str]:
    """The headers for an answer of this media type (for answers built outside the
    middleware, such as the 500 handler's)."""
    html = (content_type or "").startswith("text/html")
    return {**_ALWAYS, "Content-Security-Policy": CSP_PAGES if html else _CSP_DATA}


class SecurityHeadersMiddleware:
    """Adds `security_headers` to every HTTP answer; a header the route set itself (the event
    stream's Cache-Control) is left as it is. Plain ASGI, so polling pays no extra task."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in security_headers(headers.get("content-type")).items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
