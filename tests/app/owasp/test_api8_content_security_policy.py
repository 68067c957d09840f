"""OWASP API8:2023 Security Misconfiguration: the HTML pages' Content-Security-Policy.

The finding: the dashboard's pages and Swagger UI sent only `frame-ancestors 'none'`, so a
script that found its way into a page (text of a run rendered as markup, say) could run
inline, load code from anywhere and send a user's API key out. They render with
`textContent`; the policy is the second line of defence.

Now every page loads scripts, styles, images and data from this service only, and runs
nothing inline: Swagger UI starts from a file rather than FastAPI's inline script, and the
dashboard sets no style attribute. ReDoc, which injects its styles, keeps a policy of its
own that still allows no inline script. The tests read each page's policy directive by
directive and look through the pages and their scripts for anything inline the policy
would refuse. JSON answers keep theirs, `default-src 'none'`
(test_api8_security_misconfiguration.py); tests/e2e/test_dashboard.py loads the pages in
Chromium and fails on any violation the browser reports.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

from app.api.dashboard import STATIC_DIR

# The pages served under the pages' policy, and what each must show to be itself.
PAGES = ["/", "/runs/run_123", "/compare?runs=a,b", "/submit", "/docs", "/docs/oauth2-redirect"]
_ONLY_SELF = ("default-src", "script-src", "style-src", "connect-src")


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: what is served does not depend on the database."""
    return sqlite_url


def _directives(policy: str) -> dict[str, list[str]]:
    parsed = {}
    for directive in filter(None, (d.strip() for d in policy.split(";"))):
        name, *sources = directive.split()
        parsed[name] = sources
    return parsed


class _Inline(HTMLParser):
    """What a page runs or styles inline: script bodies, <style>, style and on* attributes,
    javascript: addresses."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "style":
            self.found.append("<style>")
        if tag == "script":
            self._in_script = True
            if "src" not in names:
                self.found.append("<script> without src")
        for name, value in attrs:
            if name == "style" or name.startswith("on"):
                self.found.append(f"{tag} {name}=")
            if value and value.strip().lower().startswith("javascript:"):
                self.found.append(f"{tag} {name}=javascript:")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.found.append("an inline script body")


class TestThePagesPolicy:
    @pytest.mark.parametrize("path", PAGES)
    def test_everything_comes_from_this_service_and_nothing_runs_inline(
        self, client: TestClient, path: str
    ) -> None:
        response = client.get(path)
        assert response.status_code == 200, response.text
        policy = _directives(response.headers["Content-Security-Policy"])
        for directive in _ONLY_SELF:
            assert policy.get(directive) == ["'self'"], (directive, policy)
        assert policy["img-src"] == ["'self'", "data:"]  # Swagger UI's icons
        assert policy["object-src"] == ["'none'"]
        assert policy["base-uri"] == ["'none'"]
        assert policy["form-action"] == ["'self'"]
        assert policy["frame-ancestors"] == ["'none'"]
        assert response.headers["X-Frame-Options"] == "DENY"

    def test_no_page_has_anything_inline_the_policy_would_refuse(self, client: TestClient) -> None:
        for path in PAGES:
            parser = _Inline()
            parser.feed(client.get(path).text)
            assert parser.found == [], path

    def test_swagger_ui_still_finds_the_document_and_its_redirect(self, client: TestClient) -> None:
        html = client.get("/docs").text
        assert 'data-openapi-url="/openapi.json"' in html
        assert 'data-oauth2-redirect-url="/docs/oauth2-redirect"' in html
        for script in re.findall(r'<script src="([^"]+)"', html):
            assert client.get(script).status_code == 200, script
        assert "swagger-init.js" in html

    def test_no_script_of_the_dashboard_sets_a_style_attribute(self) -> None:
        """The policy refuses style attributes (set in markup or with setAttribute); a
        script sets an element's style through its `style` object, which it allows."""
        for script in (STATIC_DIR / "js").glob("*.js"):
            text = script.read_text()
            assert not re.search(r"""setAttribute\(\s*["']style""", text), script.name
            assert not re.search(r"""[{,]\s*style\s*:""", text), script.name
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, script.name


class TestReDocsPolicy:
    def test_it_may_inject_styles_but_runs_no_inline_script(self, client: TestClient) -> None:
        response = client.get("/redoc")
        assert response.status_code == 200
        policy = _directives(response.headers["Content-Security-Policy"])
        assert policy["default-src"] == ["'self'"]
        assert policy["script-src"] == ["'self'"]
        assert policy["style-src"] == ["'self'", "'unsafe-inline'"]
        assert policy["worker-src"] == ["'self'", "blob:"]
        assert policy["object-src"] == ["'none'"]
        assert policy["base-uri"] == ["'none'"]
        assert policy["frame-ancestors"] == ["'none'"]
        # Its one script is a file.
        assert re.findall(r"<script[^>]*>\s*(\S[^<]*)</script>", response.text) == []
