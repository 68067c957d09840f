"""The OpenAPI document: valid, every operation summarised with its errors, the tutorial
examples offered in /docs, and the error shape it documents is the one clients get."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate
from sqlalchemy.orm import Session, sessionmaker

from app.schemas.errors import ErrorResponse
from app.schemas.openai_shapes import OpenAIError
from app.services.rules.run_rules import cross_field_problems
from app.storage.db import transaction
from app.storage.models import Run
from contract.examples import RUN_REQUEST_EXAMPLES
from contract.run_request import RunRequest
from tests.factories import run_request

_METHODS = ("get", "put", "post", "delete", "patch", "options", "head", "trace")
_ERROR_REF = "#/components/schemas/ErrorResponse"
# OpenAI's fine-tuning routes answer in OpenAI's error shape, a broken rule as a 400.
_OPENAI_ERROR_REF = "#/components/schemas/OpenAIError"
_OPENAI_ROUTES = "/v1/fine_tuning/"
# Both clients call the file routes, each answered in its own shape.
_SHARED_ROUTES = "/v1/files"
# What one of OpenAI's SDKs sends with every request.
_SDK_HEADERS = {"X-Stainless-Lang": "python"}


def _error_refs(path: str) -> set[str]:
    if path.startswith(_OPENAI_ROUTES):
        return {_OPENAI_ERROR_REF}
    if path.startswith(_SHARED_ROUTES):
        return {_ERROR_REF, _OPENAI_ERROR_REF}
    return {_ERROR_REF}


def _refs(schema: dict[str, Any]) -> set[str]:
    return {option["$ref"] for option in schema.get("anyOf", [schema])}


def _error_shape(path: str, headers: dict[str, str]) -> type[ErrorResponse | OpenAIError]:
    sdk = path.startswith(_SHARED_ROUTES) and "X-Stainless-Lang" in headers
    return OpenAIError if path.startswith(_OPENAI_ROUTES) or sdk else ErrorResponse


# The words an operation id may start with: what a client does, said plainly.
_VERBS = {"create", "validate", "list", "get", "update", "delete", "upload", "stream"}
_VERBS |= {"cancel", "pause", "resume"}  # a run's or a job's controls
_VERBS |= {"run"}  # OpenAI's graders/run: run one grader on one sample
# They take no input and need no key: they always answer 200 (a degraded /healthz says so
# in its body), so they have no error to document.
_NO_ERRORS = {("get", "/healthz"), ("get", "/metrics")}


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: the document does not depend on the database."""
    return sqlite_url


@pytest.fixture
def document(client: TestClient) -> dict[str, Any]:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method in _METHODS
    ]


class TestDocument:
    def test_is_a_valid_openapi_document(self, document: dict[str, Any]) -> None:
        validate(document)  # raises on any violation of the OpenAPI 3.1 specification
        assert document["openapi"].startswith("3.1")
        assert document["info"]["title"] == "tuneyard"

    def test_lists_every_route_of_the_contract(self, document: dict[str, Any]) -> None:
        listed = {(method, path) for method, path, _ in _operations(document)}
        assert {
            ("post", "/v1/runs"),
            ("post", "/v1/runs/validate"),
            ("get", "/v1/runs"),
            ("get", "/v1/runs/{run_id}"),
            ("post", "/v1/runs/{run_id}/cancel"),
            ("post", "/v1/runs/{run_id}/resume"),
            ("get", "/v1/runs/{run_id}/metrics"),
            ("get", "/v1/runs/{run_id}/checkpoints"),
            ("get", "/v1/runs/{run_id}/events"),
            ("get", "/v1/runs/{run_id}/logs"),
            ("post", "/v1/files"),
            ("get", "/healthz"),
        } <= listed

    def test_every_operation_has_a_summary(self, document: dict[str, Any]) -> None:
        unsummarised = [
            f"{method.upper()} {path}"
            for method, path, operation in _operations(document)
            if not operation.get("summary", "").strip()
        ]
        assert unsummarised == []

    def test_every_operation_documents_its_client_errors(self, document: dict[str, Any]) -> None:
        for method, path, operation in _operations(document):
            statuses = set(operation["responses"])
            if (method, path) in _NO_ERRORS:
                assert not any(s.startswith(("4", "5")) for s in statuses), path
                continue
            assert any(s.startswith("4") for s in statuses), f"{method.upper()} {path}"

    def test_every_operation_with_input_documents_its_422(self, document: dict[str, Any]) -> None:
        """A parameter or a body can break a rule; the 422 that says so has tuneyard's shape."""
        for method, path, operation in _operations(document):
            if not operation.get("parameters") and "requestBody" not in operation:
                continue
            rule_broken = "400" if path.startswith(_OPENAI_ROUTES) else "422"
            response = operation["responses"].get(rule_broken)
            assert response is not None, f"{method.upper()} {path}"
            schema = response["content"]["application/json"]["schema"]
            assert _refs(schema) == _error_refs(path), f"{method.upper()} {path}"

    def test_every_authenticated_operation_documents_its_401_challenge(
        self, document: dict[str, Any]
    ) -> None:
        """RFC 9110 §11.6.1: a 401 carries `WWW-Authenticate`; the document says so."""
        for method, path, operation in _operations(document):
            if not operation.get("security"):
                continue
            response = operation["responses"].get("401")
            assert response is not None, f"{method.upper()} {path}"
            header = response.get("headers", {}).get("WWW-Authenticate")
            assert header is not None, f"{method.upper()} {path}"
            assert header["schema"] == {"type": "string"}
            assert 'Bearer realm="tuneyard"' in header["description"]

    def test_every_error_response_has_the_error_shape(self, document: dict[str, Any]) -> None:
        for method, path, operation in _operations(document):
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")) or status == "default":
                    schema = response["content"]["application/json"]["schema"]
                    assert _refs(schema) == _error_refs(path), f"{method.upper()} {path}"
                    assert response["description"], f"{method.upper()} {path} {status}"
        # FastAPI's own 422 body (`{"detail": [{"loc": ...}]}`) is not what tuneyard sends.
        assert "HTTPValidationError" not in document["components"]["schemas"]

    def test_documents_the_errors_each_route_really_has(self, document: dict[str, Any]) -> None:
        def statuses(method: str, path: str) -> set[str]:
            return set(document["paths"][path][method]["responses"])

        assert {"200", "201", "401", "409", "422"} <= statuses("post", "/v1/runs")
        assert {"401", "404", "409"} <= statuses("post", "/v1/runs/{run_id}/cancel")
        assert {"401", "404", "409"} <= statuses("post", "/v1/runs/{run_id}/resume")
        assert {"401", "404", "503"} <= statuses("get", "/v1/runs/{run_id}/logs")
        assert {"401", "413", "422"} <= statuses("post", "/v1/files")
        assert {"401", "404"} <= statuses("get", "/v1/files/{file_id}")
        assert "404" not in statuses("get", "/v1/runs")  # a list is never missing

    def test_declares_the_credentials_each_route_takes(self, document: dict[str, Any]) -> None:
        """So that /docs can send them: its "Authorize" button lists these schemes."""
        schemes = document["components"]["securitySchemes"]
        assert schemes["APIKey"] == {
            "type": "http",
            "scheme": "bearer",
            "description": schemes["APIKey"]["description"],
        }
        # The run token is the worker callbacks' only, and they are not in the document.
        assert set(schemes) == {"APIKey"}
        for method, path, operation in _operations(document):
            expected = None if (method, path) in _NO_ERRORS else [{"APIKey": []}]
            assert operation.get("security") == expected, f"{method.upper()} {path}"

    def test_operation_ids_are_plain_verbs(self, document: dict[str, Any]) -> None:
        """What a generated client calls: the endpoint's name, never FastAPI's default that
        spells out path and method (`create_run_v1_runs_post`)."""
        ids = {
            (method, path): operation["operationId"]
            for method, path, operation in _operations(document)
        }
        assert {
            ("post", "/v1/runs"): "create_run",
            ("post", "/v1/runs/validate"): "validate_run",
            ("get", "/v1/runs"): "list_runs",
            ("get", "/v1/runs/{run_id}"): "get_run",
            ("post", "/v1/runs/{run_id}/cancel"): "cancel_run",
            ("post", "/v1/runs/{run_id}/resume"): "resume_run",
            ("get", "/v1/runs/{run_id}/metrics"): "list_metrics",
            ("get", "/v1/runs/{run_id}/checkpoints"): "list_checkpoints",
            ("get", "/v1/runs/{run_id}/events"): "list_events",
            ("get", "/v1/runs/{run_id}/events/stream"): "stream_events",
            ("get", "/v1/runs/{run_id}/logs"): "get_logs",
            ("post", "/v1/files"): "upload_file",
            ("get", "/v1/files/{file_id}"): "get_file",
            ("get", "/healthz"): "get_health",
            ("get", "/metrics"): "get_prometheus_metrics",
        }.items() <= ids.items()
        for (method, path), operation_id in ids.items():
            verb, *_ = operation_id.split("_")
            assert re.fullmatch(r"[a-z]+(_[a-z0-9]+)*", operation_id), operation_id
            assert verb in _VERBS, f"{method.upper()} {path}: {operation_id}"
            assert not operation_id.endswith(f"_{method}"), operation_id

    def test_operation_ids_are_unique(self, document: dict[str, Any]) -> None:
        """Two operations of one id would be one function in a generated client. Route names
        are the ids, and nothing else keeps two routers from reusing a name."""
        ids = [operation.get("operationId") for _, _, operation in _operations(document)]
        assert None not in ids
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        assert duplicates == []

    def test_schema_names_are_plain(self, document: dict[str, Any]) -> None:
        """Two models of one name are filed under their module paths
        (`contract__run_request__DpoMethod`), which client generators turn back into one
        class name: a clash that drops every schema using either."""
        qualified = [name for name in document["components"]["schemas"] if "__" in name]
        assert qualified == []

    def test_an_upload_is_a_binary_string(self, document: dict[str, Any]) -> None:
        """OpenAPI 3.1's `contentMediaType`, and 3.0's `format: binary` that most client
        generators still look for: without it they send the file as a text field."""
        schema = document["paths"]["/v1/files"]["post"]["requestBody"]["content"][
            "multipart/form-data"
        ]["schema"]
        name = schema["$ref"].removeprefix("#/components/schemas/")
        upload = document["components"]["schemas"][name]["properties"]["file"]
        assert upload == {
            "type": "string",
            "contentMediaType": "application/octet-stream",
            "format": "binary",
            "title": "File",
        }

    def test_the_run_request_schema_has_the_tutorial_examples(
        self, document: dict[str, Any]
    ) -> None:
        # Validation takes the run request plus its own fields (`profile`), in a schema of
        # its own: `POST /v1/runs` refuses those as unknown.
        bodies = {"/v1/runs": "RunRequest", "/v1/runs/validate": "ValidateRequest"}
        for path, name in bodies.items():
            content = document["paths"][path]["post"]["requestBody"]["content"]
            media = content["application/json"]
            assert media["schema"]["$ref"] == f"#/components/schemas/{name}", path
            assert media["examples"] == RUN_REQUEST_EXAMPLES, path
            for example in media["examples"].values():
                assert example["summary"]
            # Shown beside the schema too, for clients that read only schemas.
            schema_examples = document["components"]["schemas"][name]["examples"]
            assert schema_examples == [e["value"] for e in RUN_REQUEST_EXAMPLES.values()]
        schemas = document["components"]["schemas"]
        run_fields = set(schemas["RunRequest"]["properties"])
        assert set(schemas["ValidateRequest"]["properties"]) - run_fields == {
            "profile",
            "profile_steps",
        }
        assert schemas["ValidateRequest"]["additionalProperties"] is False
        report = schemas["ValidationReport"]["properties"]
        assert {"$ref": "#/components/schemas/ProfileView"} in report["profile"]["anyOf"]
        assert "estimated_finish" in schemas["ProgressView"]["properties"]


class TestExamples:
    @pytest.mark.parametrize("name", sorted(RUN_REQUEST_EXAMPLES))
    def test_each_example_meets_the_schema_and_the_rules_between_fields(self, name: str) -> None:
        request = RunRequest.model_validate(RUN_REQUEST_EXAMPLES[name]["value"])
        assert cross_field_problems(request) == []

    def test_the_examples_are_the_tutorial_setups(self) -> None:
        gpt2, qwen, bert = (
            RunRequest.model_validate(RUN_REQUEST_EXAMPLES[name]["value"])
            for name in ("gpt2-zero3", "qwen2.5-0.5b-autotp", "bert-mrpc-zero3")
        )
        assert (gpt2.model, gpt2.task, gpt2.deepspeed.zero_stage) == ("gpt2", "causal_lm", 3)

        assert qwen.model == "Qwen/Qwen2.5-0.5B"
        tp, workers = qwen.deepspeed.tensor_parallel_size, qwen.resources.num_workers
        assert (tp, workers // tp) == (2, 2)  # tp=2 x dp=2
        assert qwen.resources.use_gpu
        assert (qwen.dataset.source, qwen.dataset.config) == (
            "Salesforce/wikitext",
            "wikitext-2-raw-v1",
        )

        assert (bert.model, bert.task, bert.deepspeed.zero_stage) == (
            "bert-base-uncased",
            "sequence_classification",
            3,
        )
        assert (bert.dataset.source, bert.dataset.config) == ("nyu-mll/glue", "mrpc")
        assert (bert.dataset.text_field, bert.dataset.text_pair_field) == ("sentence1", "sentence2")
        assert bert.dataset.label_field == "label"

    @pytest.mark.parametrize("name", sorted(RUN_REQUEST_EXAMPLES))
    def test_each_example_validates_offline(
        self, client: TestClient, auth: dict[str, str], name: str
    ) -> None:
        """Hub ids are resolved on the cluster, so the service checks all the rest here."""
        body = RUN_REQUEST_EXAMPLES[name]["value"]
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is True, report["errors"]
        assert (
            report["resolved"]["deepspeed_config"]["zero_optimization"]["stage"]
            == (body["deepspeed"]["zero_stage"])
        )


class TestErrorsAsDocumented:
    """The bodies clients really get for each documented error status have `ErrorResponse`'s
    shape: a code and a sentence, or a list of field problems for a 422."""

    def test_401_404_409_and_422(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        unauthorized = client.get("/v1/runs/run_nope")
        assert unauthorized.status_code == 401
        assert ErrorResponse.model_validate(unauthorized.json()).error == "unauthorized"

        missing = client.get("/v1/runs/run_nope", headers=auth)
        assert missing.status_code == 404
        assert ErrorResponse.model_validate(missing.json()).error == "not_found"

        run = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()
        conflict = client.post(f"/v1/runs/{run['id']}/resume", headers=auth)  # still queued
        assert conflict.status_code == 409, conflict.text
        assert ErrorResponse.model_validate(conflict.json()).error in {
            "conflict",
            "invalid_transition",
        }

        invalid = client.post(
            "/v1/runs", json=run_request(tmp_path, deepspeed={"zero_stage": 7}), headers=auth
        )
        assert invalid.status_code == 422
        problems = ErrorResponse.model_validate(invalid.json()).detail
        assert isinstance(problems, list)
        assert problems[0].field == "deepspeed.zero_stage"

    def test_503_is_json_on_a_plain_text_route(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        run = client.post("/v1/runs", json=run_request(tmp_path), headers=auth).json()
        with transaction(session_factory) as session:
            session.get_one(Run, run["id"]).ray_submission_id = f"{run['id']}-1"
        # This app is not attached to Ray (start_background=False).
        response = client.get(f"/v1/runs/{run['id']}/logs", headers=auth)
        assert response.status_code == 503
        assert response.headers["content-type"].startswith("application/json")
        assert ErrorResponse.model_validate(response.json()).error == "ray_unavailable"


class TestStatusesAsDocumented:
    """Each operation, provoked into its errors (no key, a wrong key, a broken parameter, a
    broken body), answers only statuses its entry in the document lists, in the documented
    shape and with the documented headers."""

    def test_every_provoked_status_is_documented(
        self, client: TestClient, auth: dict[str, str], document: dict[str, Any]
    ) -> None:
        checked = 0
        for method, path, operation in _operations(document):
            url = path.format(run_id="run_nope", file_id="file_nope", job_id="run_nope")
            for headers, params, content in _provocations(operation, auth):
                response = client.request(
                    method, url, headers=headers, params=params, content=content
                )
                where = f"{method.upper()} {url} {params} {content!r:.40}: {response.status_code}"
                responses = operation["responses"]
                documented = responses.get(str(response.status_code)) or responses.get("default")
                assert documented is not None, where
                if response.status_code >= 400:
                    _error_shape(path, headers).model_validate(response.json())
                for header in documented.get("headers", {}):
                    assert header in response.headers, f"{where} lacks {header}"
                checked += 1
        assert checked > 50  # the provocations really ran


class TestWorkerCallbacksUndocumented:
    """The worker's callbacks are served, but the public document does not show them: only
    tuneyard's worker, holding a run's token, may call them."""

    def test_no_callback_is_in_the_document(self, document: dict[str, Any]) -> None:
        assert [path for path in document["paths"] if path.startswith("/v1/internal")] == []
        assert "RunToken" not in document["components"]["securitySchemes"]
        tags = {t for _, _, operation in _operations(document) for t in operation["tags"]}
        assert "worker callbacks" not in tags

    def test_a_callback_still_works(
        self,
        client: TestClient,
        auth: dict[str, str],
        document: dict[str, Any],
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        posted = client.post(
            f"/v1/internal/runs/{run_id}/status",
            json={"attempt": 1, "status": "running"},
            headers=worker,
        )
        assert posted.status_code == 200, posted.text
        assert posted.json() == {"status": "running"}
        assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["status"] == "running"

        # A refused token is a 401 with the challenge every documented 401 carries.
        refused = client.post(
            f"/v1/internal/runs/{run_id}/metrics",
            json={"attempt": 1, "points": []},
            headers={"Authorization": "Bearer not-the-run-token"},
        )
        assert refused.status_code == 401, refused.text
        assert ErrorResponse.model_validate(refused.json()).error == "unauthorized"
        documented = document["paths"]["/v1/runs/{run_id}"]["get"]["responses"]["401"]
        for header in documented["headers"]:
            assert header in refused.headers


def _provocations(
    operation: dict[str, Any], auth: dict[str, str]
) -> list[tuple[dict[str, str], dict[str, str], bytes | None]]:
    """(headers, query parameters, body) that should each make the operation refuse."""
    cases: list[tuple[dict[str, str], dict[str, str], bytes | None]] = []
    body = b"{}" if "requestBody" in operation else None
    if operation.get("security"):
        cases.append(({}, {}, body))
        cases.append(({"Authorization": "Bearer not-a-key"}, {}, body))
        # OpenAI's SDKs get OpenAI's shape only where they call (a fuzzed case found a
        # tuneyard route answering in it).
        cases.append((_SDK_HEADERS, {}, body))
    for parameter in operation.get("parameters", []):
        name, where = parameter["name"], parameter["in"]
        if where == "query":
            for value in ("NaN", "-1", "x" * 5000, "\x00"):
                cases.append((auth, {name: value}, body))
                cases.append(({**auth, **_SDK_HEADERS}, {name: value}, body))
        elif where == "header":
            for value in ("x" * 300, "not:an:id"):
                cases.append(({**auth, name: value}, {}, body))
    if "requestBody" in operation:
        json_body = {**auth, "Content-Type": "application/json"}
        for broken in (b"", b"[]", b"{", b"\xff\xfe", b'{"attempt": 1e999}'):
            cases.append((json_body, {}, broken))
    return cases


class TestDocs:
    def test_swagger_ui_loads_the_document(self, client: TestClient) -> None:
        response = client.get("/docs")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert "swagger-ui" in response.text
        assert "'/openapi.json'" in response.text or '"/openapi.json"' in response.text
