"""OWASP API8:2023 Security Misconfiguration: what every answer says about the service.

401s name the scheme to authenticate with, 405s the methods there are; a server error tells
the client nothing of the code, paths or settings behind it; answers carry the headers that
keep a browser from caching, sniffing or framing them; the interactive docs show the API,
never the deployment.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app.main import create_app
from app.schemas.errors import ErrorResponse
from app.schemas.openai_shapes import OpenAIError
from app.services import runs as run_service
from app.settings import Settings
from tests.factories import run_request

_CHALLENGE = 'Bearer realm="tuneyard"'
_REFUSED_CHALLENGE = 'Bearer realm="tuneyard", error="invalid_token"'
_METHODS = ("get", "put", "post", "delete", "patch", "options", "head", "trace")


@pytest.fixture
def document(client: TestClient) -> dict[str, Any]:
    body: dict[str, Any] = client.get("/openapi.json").json()
    return body


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method in _METHODS
    ]


def _url(path: str) -> str:
    return path.format(run_id="run_nope", file_id="file_nope", job_id="run_nope")


def _error_shape(path: str) -> type[BaseModel]:
    """OpenAI's routes answer in OpenAI's error shape (app/api/openai_compat.py)."""
    return OpenAIError if path.startswith("/v1/fine_tuning/") else ErrorResponse


class TestUnauthorizedNamesTheScheme:
    """RFC 9110 §11.6.1: a 401 carries `WWW-Authenticate`; RFC 6750 §3 gives its form."""

    def test_every_api_key_route_challenges_a_request_without_a_key(
        self, client: TestClient, document: dict[str, Any]
    ) -> None:
        challenged = 0
        for method, path, operation in _operations(document):
            if operation.get("security") != [{"APIKey": []}]:
                continue
            response = client.request(method, _url(path))
            assert response.status_code == 401, f"{method.upper()} {path}"
            assert response.headers.get("WWW-Authenticate") == _CHALLENGE, path
            challenged += 1
        assert challenged >= 12

    def test_a_refused_key_is_an_invalid_token(self, client: TestClient) -> None:
        response = client.get("/v1/runs", headers={"Authorization": "Bearer tyk_not_a_key"})
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"] == _REFUSED_CHALLENGE
        assert ErrorResponse.model_validate(response.json()).error == "unauthorized"

    def test_another_scheme_is_answered_with_the_bearer_challenge(self, client: TestClient) -> None:
        response = client.get("/v1/runs", headers={"Authorization": "Basic dXNlcjpwYXNz"})
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"] == _CHALLENGE

    def test_a_worker_callback_with_a_wrong_run_token_is_challenged(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        run = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()
        for path in ("status", "metrics", "checkpoints", "events"):
            url = f"/v1/internal/runs/{run['id']}/{path}"
            missing = client.post(url, json={"attempt": 1})
            assert missing.status_code == 401, missing.text
            assert missing.headers.get("WWW-Authenticate") == _CHALLENGE, path
            wrong = client.post(url, json={"attempt": 1}, headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401, wrong.text
            assert wrong.headers.get("WWW-Authenticate") == _REFUSED_CHALLENGE, path


class TestMethodNotAllowedListsTheMethods:
    """RFC 9110 §15.5.6: a 405 carries `Allow` with every method the resource answers.
    Without CORS configured, OPTIONS is one more method the API does not answer."""

    def test_every_path_names_all_its_methods(
        self, client: TestClient, auth: dict[str, str], document: dict[str, Any]
    ) -> None:
        for path in document["paths"]:
            # Templates overlap (/v1/runs/validate is a {run_id} too): a URL answers the
            # methods of every template it fits.
            methods = {
                method.upper()
                for template, item in document["paths"].items()
                if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), _url(path))
                for method in item
                if method in _METHODS
            }
            for method in {"PUT", "PATCH", "DELETE", "OPTIONS"} - methods:
                response = client.request(method, _url(path), headers=auth)
                where = f"{method} {path}"
                assert response.status_code == 405, where
                allowed = {m.strip() for m in response.headers.get("Allow", "").split(",")}
                assert allowed == methods, where
                assert _error_shape(path).model_validate(response.json()), where

    def test_options_on_the_runs_collection_names_get_and_post(self, client: TestClient) -> None:
        """Two routes share the path; Starlette named only the first one's method."""
        response = client.options("/v1/runs")
        assert response.status_code == 405
        assert response.headers["Allow"] == "GET, POST"


class TestServerErrorsRevealNothing:
    @pytest.fixture
    def tolerant_client(self, settings: Settings) -> Iterator[TestClient]:
        """Answers a server error as a client sees it, rather than raising it in the test."""
        app = create_app(settings, start_background=False)
        with TestClient(app, raise_server_exceptions=False) as test_client:
            yield test_client

    def test_an_unexpected_exception_is_the_generic_error(
        self,
        tolerant_client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        def broken(*_: object, **__: object) -> None:
            raise RuntimeError(f"/secret/path {settings.resolved_database_url}")

        monkeypatch.setattr(run_service, "list_runs", broken)
        response = tolerant_client.get("/v1/runs", headers=auth)

        assert response.status_code == 500
        assert response.headers["content-type"].startswith("application/json")
        error = ErrorResponse.model_validate(response.json())
        assert error.error == "internal_error"
        for leak in ("/secret/path", "RuntimeError", "Traceback", "app/", ".py", "sqlite"):
            assert leak not in response.text
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["Cache-Control"] == "no-store"


class TestSecurityHeaders:
    """OWASP REST Security Cheat Sheet, "Security headers" for an API's answers."""

    def test_an_authenticated_answer_is_neither_cached_nor_sniffed_nor_framed(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        response = client.get("/v1/runs", headers=auth)
        assert response.status_code == 200
        assert response.headers["Cache-Control"] == "no-store"
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["Content-Security-Policy"] == (
            "default-src 'none'; frame-ancestors 'none'"
        )

    def test_error_answers_carry_them_too(self, client: TestClient, auth: dict[str, str]) -> None:
        for response in (
            client.get("/v1/runs"),  # 401
            client.get("/v1/runs/run_nope", headers=auth),  # 404
            client.delete("/v1/runs", headers=auth),  # 405
            client.get("/v1/runs?limit=0", headers=auth),  # 422
            client.get("/nowhere"),  # 404 from the router
        ):
            assert response.status_code >= 400
            assert response.headers["X-Content-Type-Options"] == "nosniff", response.url
            assert response.headers["Cache-Control"] == "no-store", response.url

    def test_the_docs_page_may_load_swagger_ui_but_not_be_framed(self, client: TestClient) -> None:
        # The pages' policy: test_api8_content_security_policy.py.
        response = client.get("/docs")
        assert response.status_code == 200
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
        assert response.headers["X-Content-Type-Options"] == "nosniff"


class TestDocsLeakNoSettings:
    def test_the_document_and_the_docs_page_name_no_setting(
        self, client: TestClient, settings: Settings, tmp_path: Path, api_key: str
    ) -> None:
        secrets = {
            api_key,
            settings.resolved_database_url,
            settings.storage.root,
            str(settings.home),
            str(tmp_path),
            *(str(root) for root in settings.resolved_allowed_roots),
        }
        for url in ("/openapi.json", "/docs", "/redoc"):
            response = client.get(url)
            assert response.status_code == 200, url
            for secret in secrets:
                assert secret not in response.text, f"{url} shows {secret!r}"
