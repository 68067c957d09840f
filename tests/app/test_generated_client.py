"""A typed Python client generated from /openapi.json by openapi-python-client drives the
service, in-process, on SQLite and on PostgreSQL.

What it proves: the document is complete and precise enough for an off-the-shelf generator
(no warnings), each operation becomes a function named by its plain-verb operation id, the
worker callbacks are not among them, and the typed models the client builds from the
service's answers hold the values the service sent.
"""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.factories import run_request

_PACKAGE = "tuneyard_client"

# The operations this module calls, where the generator puts them: api/<tag>/<operation id>.py.
_CALLED = {
    "runs": {
        "create_run",
        "validate_run",
        "list_runs",
        "get_run",
        "list_metrics",
        "list_events",
        "cancel_run",
    },
    "files": {"upload_file", "get_file"},
    "health": {"get_health"},
}


def _openapi_document() -> dict[str, Any]:
    """Read from an app that never starts: the document does not depend on settings."""
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(home=Path(home), database_url=f"sqlite:///{home}/unused.db")
        document: dict[str, Any] = create_app(settings, start_background=False).openapi()
        return document


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return _openapi_document()


class Generation(NamedTuple):
    root: Path  # holds the package
    output: str  # what the generator said: its warnings name what it could not read


@pytest.fixture(scope="module")
def generation(tmp_path_factory: pytest.TempPathFactory, document: dict[str, Any]) -> Generation:
    """The client, generated once for the module (under a second)."""
    root = tmp_path_factory.mktemp("generated-client")
    schema = root / "openapi.json"
    schema.write_text(json.dumps(document))
    # No post hooks: the generator would format its output with whatever `ruff` is on PATH.
    config = root / "config.json"
    config.write_text(json.dumps({"post_hooks": []}))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(schema),
            "--output-path",
            str(root / _PACKAGE),
            "--meta",
            "none",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Generation(root, result.stdout + result.stderr)


@pytest.fixture(scope="module")
def generated(generation: Generation) -> Iterator[ModuleType]:
    """The generated package, imported; forgotten again after the module."""
    sys.path.insert(0, str(generation.root))
    try:
        yield importlib.import_module(_PACKAGE)
    finally:
        sys.path.remove(str(generation.root))
        for name in [n for n in sys.modules if n == _PACKAGE or n.startswith(f"{_PACKAGE}.")]:
            del sys.modules[name]


def _module(name: str) -> Any:
    """`models`, `types`, …: a module of the generated package."""
    return importlib.import_module(f"{_PACKAGE}.{name}")


def _operation(operation_id: str) -> Any:
    """The generated module of one operation: `sync(...)`, `sync_detailed(...)`, …"""
    (tag,) = [tag for tag, operations in _CALLED.items() if operation_id in operations]
    return _module(f"api.{tag}.{operation_id}")


def _generated_operations(root: Path) -> dict[str, set[str]]:
    """{tag folder: {operation module names}} of the generated package."""
    return {
        folder.name: {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        for folder in (root / _PACKAGE / "api").iterdir()
        if folder.is_dir() and not folder.name.startswith("__")
    }


@pytest.fixture
def api(generated: ModuleType, client: TestClient, api_key: str) -> Any:
    """The generated client, sending its requests through the app's TestClient (an
    httpx.Client). `set_httpx_client` replaces the headers the client would have built from
    its token, so the TestClient carries the key."""
    client.headers["Authorization"] = f"Bearer {api_key}"
    return generated.AuthenticatedClient(
        base_url=str(client.base_url), token=api_key, raise_on_unexpected_status=True
    ).set_httpx_client(client)


class TestGeneration:
    def test_the_generator_reads_the_whole_document(self, generation: Generation) -> None:
        """Each warning is a part of the document (a schema, an operation) it left out."""
        assert "warning" not in generation.output.lower(), generation.output

    def test_each_operation_is_a_function_named_by_its_id(
        self, generation: Generation, document: dict[str, Any]
    ) -> None:
        generated = _generated_operations(generation.root)
        names = [name for operations in generated.values() for name in operations]
        ids = [
            operation["operationId"]
            for item in document["paths"].values()
            for operation in item.values()
            if "operationId" in operation
        ]
        # Every operation made it into the client (none dropped for a schema the generator
        # could not read), under its own id: no `create_run_v1_runs_post`.
        assert sorted(names) == sorted(ids)
        for tag, operations in _CALLED.items():
            assert operations <= generated[tag], tag
        # The worker callbacks are not for clients.
        assert "worker_callbacks" not in generated
        assert not {"post_status", "post_metrics", "post_checkpoint", "post_event"} & set(names)

    def test_each_operation_module_has_the_call_functions(
        self, generation: Generation, generated: ModuleType
    ) -> None:
        for tag, operations in _generated_operations(generation.root).items():
            for operation in operations:
                module = _module(f"api.{tag}.{operation}")
                # (Plain `sync`, the parsed model alone, only where there is a model.)
                for function in ("sync_detailed", "asyncio_detailed"):
                    assert callable(getattr(module, function, None)), f"{operation}.{function}"


class TestRuns:
    def test_validate_a_run(self, api: Any, tmp_path: Path) -> None:
        models = _module("models")
        validate_run = _operation("validate_run")

        good = validate_run.sync(
            client=api, body=models.RunRequest.from_dict(run_request(tmp_path))
        )
        assert isinstance(good, models.ValidationReport)
        assert good.valid is True
        assert good.errors == []
        resolved = good.resolved.to_dict()
        assert resolved["deepspeed_config"]["zero_optimization"]["stage"] == 2

        body = run_request(tmp_path, deepspeed={"zero_stage": 2, "offload_params": "cpu"})
        bad = validate_run.sync(client=api, body=models.RunRequest.from_dict(body))
        assert isinstance(bad, models.ValidationReport)
        assert bad.valid is False
        assert [e.to_dict()["field"] for e in bad.errors] == ["deepspeed.offload_params"]

    def test_create_get_list_read_metrics_and_cancel(self, api: Any, tmp_path: Path) -> None:
        models = _module("models")
        body = models.RunRequest.from_dict(run_request(tmp_path, metadata={"team": "nlp"}))

        created = _operation("create_run").sync_detailed(
            client=api, body=body, idempotency_key="k-1"
        )
        assert created.status_code == 201
        run = created.parsed
        assert isinstance(run, models.RunView)
        assert run.id.startswith("run_")
        assert run.status == "queued"
        assert run.attempt == 1
        assert run.spec.to_dict()["training"]["max_steps"] == 5
        assert run.metadata.to_dict() == {"team": "nlp"}

        again = _operation("create_run").sync_detailed(client=api, body=body, idempotency_key="k-1")
        assert again.status_code == 200
        assert again.parsed.id == run.id

        fetched = _operation("get_run").sync(run.id, client=api)
        assert isinstance(fetched, models.RunView)
        assert (fetched.id, fetched.status, fetched.created_at) == (
            run.id,
            "queued",
            run.created_at,
        )

        listed = _operation("list_runs").sync(client=api, status=models.RunStatus.QUEUED, limit=10)
        assert isinstance(listed, models.RunList)
        assert [r.id for r in listed.data] == [run.id]
        assert listed.next_cursor is None

        metrics = _operation("list_metrics").sync(run.id, client=api, name="loss")
        assert isinstance(metrics, models.MetricList)
        assert (metrics.data, metrics.next_cursor) == ([], None)

        events = _operation("list_events").sync(run.id, client=api)
        assert isinstance(events, models.EventList)
        assert events.data  # at least its creation

        cancelled = _operation("cancel_run").sync(run.id, client=api)
        assert isinstance(cancelled, models.RunView)
        assert cancelled.status == "cancelled"
        assert cancelled.finished_at is not None
        assert _operation("list_runs").sync(client=api, status=models.RunStatus.QUEUED).data == []

    def test_a_missing_run_is_the_error_model(self, api: Any) -> None:
        models = _module("models")
        missing = _operation("get_run").sync_detailed("run_nope", client=api)
        assert missing.status_code == 404
        assert isinstance(missing.parsed, models.ErrorResponse)
        assert missing.parsed.error == "not_found"

    def test_a_broken_rule_is_a_422_parsed_into_the_error_model(
        self, api: Any, tmp_path: Path
    ) -> None:
        models = _module("models")
        body = run_request(tmp_path, deepspeed={"zero_stage": 2, "offload_params": "cpu"})
        refused = _operation("create_run").sync_detailed(
            client=api, body=models.RunRequest.from_dict(body)
        )
        assert refused.status_code == 422
        error = refused.parsed
        assert isinstance(error, models.ErrorResponse)
        assert error.error == "validation_error"
        assert [type(p) for p in error.detail] == [models.Problem]
        assert error.detail[0].field == "deepspeed.offload_params"
        assert "zero_stage 3" in error.detail[0].message
        # Nothing was stored.
        assert _operation("list_runs").sync(client=api).data == []

    def test_a_broken_parameter_is_a_422_naming_it(self, api: Any) -> None:
        models = _module("models")
        refused = _operation("list_runs").sync_detailed(client=api, limit=0)
        assert refused.status_code == 422
        assert isinstance(refused.parsed, models.ErrorResponse)
        assert [p.field for p in refused.parsed.detail] == ["limit"]


class TestFiles:
    def test_upload_then_get(self, api: Any) -> None:
        models = _module("models")
        content = b'{"text": "hello world"}\n{"text": "another line"}\n{"text": "third"}\n'
        file = _module("types").File(
            payload=io.BytesIO(content), file_name="train.jsonl", mime_type="application/json"
        )
        body = models.BodyUploadFile(file=file)  # `purpose` left to its default, text

        uploaded = _operation("upload_file").sync_detailed(client=api, body=body)
        assert uploaded.status_code == 201, uploaded.content
        view = uploaded.parsed
        assert isinstance(view, models.FileView)
        assert view.id.startswith("file_")
        assert (view.filename, view.format_, view.purpose) == ("train.jsonl", "jsonl", "text")
        assert (view.records, view.bytes_, view.fields) == (3, len(content), ["text"])

        fetched = _operation("get_file").sync(view.id, client=api)
        assert isinstance(fetched, models.FileView)
        assert fetched.to_dict() == view.to_dict()


class TestHealth:
    def test_health_without_a_key(self, generated: ModuleType, client: TestClient) -> None:
        models = _module("models")
        anonymous = generated.Client(base_url=str(client.base_url)).set_httpx_client(client)
        health = _operation("get_health").sync(client=anonymous)
        assert isinstance(health, models.HealthView)
        assert health.database == "ok"
        assert health.ray.reachable is False  # this app is not attached to Ray
        assert health.status == models.HealthViewStatus.DEGRADED
