"""The dashboard and the API docs are served by the app itself, from vendored files: pages
and assets answer without a key, nothing loads from a CDN, and the API still wants a key."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.dashboard import STATIC_DIR
from app.api.security_headers import CSP_PAGES
from contract.statuses import RESUMABLE_STATUSES, TERMINAL_STATUSES, RunStatus

PAGES = {
    "/": "runs-list.js",
    "/runs/run_123": "run-page.js",
    "/compare?runs=a,b": "compare.js",
    "/submit": "submit.js",
}
VENDORED = [
    "/static/vendor/uplot/uPlot.iife.min.js",
    "/static/vendor/uplot/uPlot.min.css",
    "/static/vendor/swagger-ui-dist/swagger-ui-bundle.js",
    "/static/vendor/swagger-ui-dist/swagger-ui.css",
    "/static/vendor/swagger-ui-dist/favicon-32x32.png",
    "/static/vendor/redoc/redoc.standalone.js",
]
_URL_IN_TAG = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: what is served does not depend on the database."""
    return sqlite_url


def _loaded_urls(html: str) -> list[str]:
    return _URL_IN_TAG.findall(html)


class TestPages:
    @pytest.mark.parametrize("path", PAGES)
    def test_each_page_is_served_without_a_key(self, client: TestClient, path: str) -> None:
        response = client.get(path)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert f'src="/static/js/{PAGES[path]}"' in response.text
        assert 'id="key-dialog"' in response.text
        # The HTML may load this service's scripts, but never be framed.
        assert response.headers["Content-Security-Policy"] == CSP_PAGES

    @pytest.mark.parametrize("path", PAGES)
    def test_every_asset_a_page_loads_is_local_and_served(
        self, client: TestClient, path: str
    ) -> None:
        urls = _loaded_urls(client.get(path).text)
        assert urls
        for url in urls:
            if url.startswith("/static/"):
                assert client.get(url).status_code == 200, url
            else:
                assert url.startswith("/") and not url.startswith("//"), url

    def test_every_module_a_script_imports_is_served(self, client: TestClient) -> None:
        scripts = STATIC_DIR / "js"
        for script in scripts.glob("*.js"):
            for name in re.findall(r'from "\./([\w-]+\.js)"', script.read_text()):
                response = client.get(f"/static/js/{name}")
                assert response.status_code == 200, f"{script.name} imports missing {name}"
                assert response.headers["content-type"].startswith("text/javascript"), name

    def test_the_pages_branch_on_the_contracts_statuses(self, client: TestClient) -> None:
        """Which statuses are final or resumable is said once (contract/statuses.py); the
        scripts import it rather than list statuses of their own."""
        module = client.get("/static/js/statuses.js").text
        sets = dict(re.findall(r"export const (\w+) = new Set\((\[.*?\])\);", module))
        assert {name: set(json.loads(values)) for name, values in sets.items()} == {
            "TERMINAL": {str(s) for s in TERMINAL_STATUSES},
            "RESUMABLE": {str(s) for s in RESUMABLE_STATUSES},
        }
        [every] = re.findall(r"export const ALL = (\[.*?\]);", module)
        assert json.loads(every) == [str(s) for s in RunStatus]
        for script in (STATIC_DIR / "js").glob("*.js"):
            assert not re.search(r'"(succeeded|cancelled|preempting)"', script.read_text()), (
                script.name
            )
        # The list page's filter too: its options come from ALL.
        assert "<option>" not in (STATIC_DIR / "index.html").read_text()


class TestVendoredAssets:
    @pytest.mark.parametrize("url", VENDORED)
    def test_is_served(self, client: TestClient, url: str) -> None:
        response = client.get(url)
        assert response.status_code == 200
        assert len(response.content) > 500

    def test_each_library_keeps_its_licence_and_the_readme_names_its_version(self) -> None:
        vendor = STATIC_DIR / "vendor"
        readme = (vendor / "README.md").read_text()
        for name, version in (
            ("uplot", "1.6.32"),
            ("swagger-ui-dist", "5.35.0"),
            ("redoc", "2.5.4"),
        ):
            assert (vendor / name / "LICENSE").is_file(), name
            assert f"| {version} |" in readme, name

    def test_a_path_outside_the_static_folder_is_refused(self, client: TestClient) -> None:
        assert client.get("/static/../main.py").status_code == 404
        assert client.get("/static/%2e%2e/main.py").status_code == 404


class TestDocsUseVendoredAssets:
    @pytest.mark.parametrize("path", ["/docs", "/redoc"])
    def test_no_cdn(self, client: TestClient, path: str) -> None:
        response = client.get(path)
        assert response.status_code == 200
        assert not re.search(r"https?://", response.text), response.text
        urls = _loaded_urls(response.text)
        assert any(u.startswith("/static/vendor/") and u.endswith(".js") for u in urls), urls
        for url in urls:
            assert client.get(url).status_code == 200, url

    def test_swagger_ui_loads_the_document_and_keeps_its_oauth_redirect(
        self, client: TestClient
    ) -> None:
        html = client.get("/docs").text
        assert "/openapi.json" in html
        assert "/docs/oauth2-redirect" in html
        redirect = client.get("/docs/oauth2-redirect")
        assert redirect.status_code == 200
        assert "oauth2" in redirect.text.lower()

    def test_redoc_loads_the_document(self, client: TestClient) -> None:
        assert 'spec-url="/openapi.json"' in client.get("/redoc").text

    def test_redoc_may_load_images_from_this_service_only(self, client: TestClient) -> None:
        # ReDoc's bundle shows its maker's logo from cdn.redoc.ly: the policy keeps the
        # browser from asking (checked in Chromium: only that request was blocked).
        policy = client.get("/redoc").headers["content-security-policy"]
        assert "img-src 'self' data:" in policy
        assert "frame-ancestors 'none'" in policy


class TestSchema:
    def test_the_pages_are_not_api_operations(self, client: TestClient) -> None:
        document: dict[str, Any] = client.get("/openapi.json").json()
        paths = set(document["paths"])
        for page in ("/", "/runs/{run_id}", "/compare", "/submit", "/docs", "/redoc"):
            assert page not in paths
        assert not any(p.startswith("/static") for p in paths)


class TestApiStillWantsAKey:
    @pytest.mark.parametrize(
        ("method", "path"),
        [
            ("GET", "/v1/runs"),
            ("GET", "/v1/runs/run_123"),
            ("GET", "/v1/runs/run_123/events/stream"),
            ("POST", "/v1/runs/validate"),
            ("POST", "/v1/runs/run_123/cancel"),
        ],
    )
    def test_without_a_key(self, client: TestClient, method: str, path: str) -> None:
        response = client.request(method, path, json={} if method == "POST" else None)
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")

    def test_with_a_key(self, client: TestClient, auth: dict[str, str]) -> None:
        assert client.get("/v1/runs", headers=auth).status_code == 200
