"""Response headers that keep a browser from misreading the API's answers (OWASP API8).

Every answer is data for one client, often about one principal's runs: nothing may cache it,
sniff it into another type, or frame it. JSON answers may not load anything either; the
HTML of /docs keeps loading Swagger UI's assets.
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
_CSP_HTML = "frame-ancestors 'none'"


def security_headers(content_type: str | None) -> dict[str, str]:
    """The headers for an answer of this media type (for answers built outside the
    middleware, such as the 500 handler's)."""
    html = (content_type or "").startswith("text/html")
    return {**_ALWAYS, "Content-Security-Policy": _CSP_HTML if html else _CSP_DATA}


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
