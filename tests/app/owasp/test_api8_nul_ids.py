"""OWASP API8:2023 Security Misconfiguration: an id a client sends is checked before any query.

The finding: PostgreSQL refuses a NUL in text, and three routes sent one to it, answering
500: `GET /v1/files/%00`, `DELETE /v1/files/%00`, and `POST /v1/fine_tuning/jobs` with a NUL
in `training_file` (looked up before it was validated). Other routes refused a NUL with a
422 of their own, or passed an id of any length to the database.

Every id the service mints is a prefix, `_` and 20 lower-case hex digits (app/storage/models.py
`new_id`); a value of any other shape names nothing. So each route answers it as it answers
an unknown id, without a query: 404 for an id in the path (in OpenAI's error shape on OpenAI's
routes), 401 on the worker callbacks (which never tell a missing run from a wrong token), and
an error naming the field for one in a body. The tests send every id-bearing operation of
the OpenAPI document, and the callbacks, a NUL, an overlong id and odd characters, on SQLite
and PostgreSQL, and expect exactly the answer of a well-formed unknown id (never a 500), with
no statement sent to the database carrying the value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event

from tests.factories import local_inputs, run_request

_METHODS = ("get", "post", "delete")
# Well-formed ids that name nothing.
_UNKNOWN = {"run_id": "run_" + "0" * 20, "job_id": "run_" + "0" * 20, "file_id": "file_" + "0" * 20}
# Ids no row can have, as a client writes them in a URL: `{id}` is a well-formed unknown id,
# `{ID}` the same in upper case, `{prefix}` its kind's prefix ("run", "file").
_MALFORMED = {
    "nul": "%00",
    "nul-after-the-prefix": "{prefix}_%00",
    "nul-after-an-id": "{id}%00",
    "overlong": "{id}" + "0" * 5_000,
    "upper-case": "{ID}",
    "quote-and-semicolon": "{id}%27%3B--",
    "non-ascii": "{id}%C3%A9",
    "invalid-utf-8": "%ED%A0%80%FF",
}
_CALLBACKS = [
    ("post", "/v1/internal/runs/{run_id}/status", {"attempt": 1, "status": "running"}),
    ("post", "/v1/internal/runs/{run_id}/metrics", {"attempt": 1, "points": []}),
    ("post", "/v1/internal/runs/{run_id}/events", {"attempt": 1, "type": "message"}),
    (
        "post",
        "/v1/internal/runs/{run_id}/checkpoints",
        {"attempt": 1, "step": 1, "path": "/c", "kind": "hf"},
    ),
    ("get", "/v1/internal/runs/{run_id}/control", None),
]


def _id_operations(client: TestClient) -> list[tuple[str, str, str]]:
    """(method, path template, its id parameter) of every operation with an id in its path."""
    document: dict[str, Any] = client.get("/openapi.json").json()
    found = []
    for path, item in document["paths"].items():
        names = re.findall(r"\{(\w+)\}", path)
        for method in item:
            if method in _METHODS and names:
                (name,) = names
                found.append((method, path, name))
    return found


def _malformed(kind: str, name: str) -> str:
    known = _UNKNOWN[name]
    template = _MALFORMED[kind].replace("{prefix}", known.split("_")[0])
    return template.replace("{id}", known).replace("{ID}", known.upper())


class Queried:
    """Every string parameter of every statement any engine sends, while the test runs."""

    def __init__(self) -> None:
        self.values: list[str] = []

    def record(self, *args: Any) -> None:
        self.values.extend(_strings(args[3]))

    def saw(self, value: str) -> bool:
        return any(value in sent for sent in self.values)


def _strings(params: Any) -> Iterator[str]:
    if isinstance(params, str):
        yield params
    elif isinstance(params, dict):
        for value in params.values():
            yield from _strings(value)
    elif isinstance(params, list | tuple):
        for value in params:
            yield from _strings(value)


@pytest.fixture
def queried() -> Iterator[Queried]:
    recorder = Queried()
    event.listen(Engine, "before_cursor_execute", recorder.record)
    yield recorder
    event.remove(Engine, "before_cursor_execute", recorder.record)


def _answer(response: Any) -> tuple[int, Any]:
    """The status and the error's code, in either shape (OpenAI's or tuneyard's)."""
    error = response.json()["error"]
    return response.status_code, error["type"] if isinstance(error, dict) else error


class TestIdsInThePath:
    @pytest.mark.parametrize("kind", _MALFORMED)
    def test_every_operation_answers_as_for_an_unknown_id(
        self, client: TestClient, auth: dict[str, str], queried: Queried, kind: str
    ) -> None:
        operations = _id_operations(client)
        assert len(operations) >= 18, operations
        for method, path, name in operations:
            where = f"{method.upper()} {path}"
            unknown = client.request(
                method, path.replace(f"{{{name}}}", _UNKNOWN[name]), headers=auth
            )
            assert unknown.status_code == 404, (where, unknown.text)
            malformed = _malformed(kind, name)
            answer = client.request(method, path.replace(f"{{{name}}}", malformed), headers=auth)
            assert _answer(answer) == _answer(unknown), (where, answer.text)
            assert not queried.saw(unquote(malformed)), f"{where}: the id reached a query"

    def test_openai_shapes_of_files_answer_so_too(
        self, client: TestClient, auth: dict[str, str], queried: Queried
    ) -> None:
        headers = {**auth, "OpenAI-Shapes": "true"}
        for method in ("get", "delete"):
            answer = client.request(method, "/v1/files/%00", headers=headers)
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["type"] == "not_found_error"
        assert not queried.saw("\x00")

    def test_without_a_key_the_answer_is_still_401(self, client: TestClient) -> None:
        """A malformed id tells a client without a key nothing either."""
        for method, path, name in _id_operations(client):
            url = path.replace(f"{{{name}}}", _malformed("nul", name))
            assert client.request(method, url).status_code == 401, f"{method} {path}"

    def test_the_worker_callbacks_answer_as_for_an_unknown_run(
        self, client: TestClient, queried: Queried
    ) -> None:
        token = {"Authorization": "Bearer rt_x"}
        for kind in _MALFORMED:
            malformed = _malformed(kind, "run_id")
            for method, path, body in _CALLBACKS:
                url = path.replace("{run_id}", malformed)
                content = json.dumps(body) if body else None
                answer = client.request(method, url, content=content, headers=token)
                assert answer.status_code == 401, (kind, path, answer.text)
            assert not queried.saw(unquote(malformed)), f"{kind}: the id reached a query"


class TestIdsInABody:
    @pytest.mark.parametrize(
        "training_file",
        ["\x00", "file_\x00", _UNKNOWN["file_id"] + "\x00", "file_" + "Z" * 20, "file_é" * 10],
        ids=["nul", "nul-after-the-prefix", "nul-after-an-id", "not-hex", "non-ascii"],
    )
    def test_a_fine_tuning_jobs_training_file_is_a_400_naming_it(
        self,
        client: TestClient,
        auth: dict[str, str],
        queried: Queried,
        tmp_path: Path,
        training_file: str,
    ) -> None:
        model, _ = local_inputs(tmp_path)
        body = {"model": str(model), "training_file": training_file}
        answer = client.post("/v1/fine_tuning/jobs", json=body, headers=auth)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "training_file"
        assert not queried.saw(training_file), "the id reached a query"
        assert client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == []

    def test_a_runs_uploaded_dataset_is_a_422_naming_it(
        self, client: TestClient, auth: dict[str, str], queried: Queried, tmp_path: Path
    ) -> None:
        for source in ("file_" + "Z" * 20, "file_" + "0" * 40, "file_" + "é" * 20):
            body = run_request(tmp_path, dataset={"source": source, "text_field": "text"})
            answer = client.post("/v1/runs", json=body, headers=auth)
            assert answer.status_code == 422, answer.text
            assert [p["field"] for p in answer.json()["detail"]] == ["dataset.source"]
            assert not queried.saw(source), f"{source!r} reached a query"


class TestNulInStoredText:
    """PostgreSQL's text holds no NUL: every string the service stores refuses one."""

    def test_a_fine_tuning_jobs_suffix(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        upload = client.post(
            "/v1/files",
            files={"file": ("a.jsonl", b'{"text": "a"}\n{"text": "b"}\n')},
            headers=auth,
        ).json()
        model, _ = local_inputs(tmp_path)
        body = {"model": str(model), "training_file": upload["id"], "suffix": "a\x00b"}
        answer = client.post("/v1/fine_tuning/jobs", json=body, headers=auth)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "suffix"
        assert "NUL" in answer.json()["error"]["message"]
        assert client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == []
