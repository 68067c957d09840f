"""Property-based fuzzing of the public API, on SQLite and on PostgreSQL.

Whatever a client sends that the document allows (and much that it does not), the service
answers without a server error, with a status the document lists for that operation, and
with a body of the documented shape. Schemathesis generates requests for every operation
from /openapi.json; hostile run requests (huge numbers, NUL bytes, lone surrogates, very
long or deeply nested values) go to the two operations that read a whole document.

The two databases fail differently (PostgreSQL refuses NUL and lone surrogates in text,
and integers beyond its column types, where SQLite stores them), so every property runs on
both; PostgreSQL gets fewer schema-generated cases, since its round trips cost more.
"""

from __future__ import annotations

import json
import math
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck
from hypothesis import strategies as st
from pydantic import BaseModel
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from app.schemas.errors import ErrorResponse
from app.schemas.run_view import RunView, ValidationReport
from app.settings import Settings
from contract.run_request import RunRequest
from tests.factories import run_request


def _openapi_document() -> dict[str, Any]:
    """Read from an app that never starts (nor touches its database): the document does not
    depend on settings. (schemathesis.pytest.from_fixture would read it from each test's own
    app, but fails on pytest 9.2.)"""
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(home=Path(home), database_url=f"sqlite:///{home}/unused.db")
        document: dict[str, Any] = create_app(settings, start_background=False).openapi()
        return document


# The worker callbacks (/v1/internal/…) are not in the document: only clients' operations.
schema = schemathesis.openapi.from_dict(_openapi_document())

_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _fuzz_settings(max_examples: int) -> hypothesis.settings:
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        # The same cases on every run, so CI cannot fail by chance; no example database.
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@pytest.fixture
def app(settings: Settings) -> Iterator[FastAPI]:
    yield create_app(settings, start_background=False)
    asgi.shutdown_lifespans()  # schemathesis starts the app's lifespan on its first call


# `database_url` (tests/conftest.py) takes its database from the parameter.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@schema.parametrize()
@_fuzz_settings(max_examples=25)
def test_the_api_answers_as_documented_on_sqlite(
    case: schemathesis.Case, app: FastAPI, auth: dict[str, str]
) -> None:
    case.call_and_validate(app=app, headers=auth, checks=_CHECKS)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@schema.parametrize()
@_fuzz_settings(max_examples=12)
def test_the_api_answers_as_documented_on_postgresql(
    case: schemathesis.Case, app: FastAPI, auth: dict[str, str]
) -> None:
    case.call_and_validate(app=app, headers=auth, checks=_CHECKS)


# -- hostile run requests ---------------------------------------------------------------------


def _leaf_fields(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], Any]:
    """Every field of the run request that holds a value, by path, with its type."""
    leaves: dict[tuple[str, ...], Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves.update(_leaf_fields(annotation, (*prefix, name)))
        else:
            leaves[(*prefix, name)] = annotation
    return leaves


_LEAVES = _leaf_fields(RunRequest)
_GROUPS = sorted({path[:1] for path, _ in _LEAVES.items() if len(path) > 1})

# Integers around every bound a database column or a JSON number has.
_HUGE_INTS = st.sampled_from(
    [-1, 0, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30]
)
_ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, 5e-324, -0.0, 1e-300])
_TEXT_NUMBERS = st.sampled_from(["NaN", "nan", "Infinity", "-inf", "1e309", "0x10", "1_000", ""])
# What PostgreSQL refuses in text (NUL, lone surrogates), what breaks a line or a path, what
# displays misleadingly.
_TRICKY_CHARS = [
    "\x00",
    "\ud800",
    "\udfff",
    "\n",
    "\t",
    "\x7f",
    "\x9b",
    "\u202e",
    "\ufeff",
    "🦙",
    "é",
]
_TRICKY_TEXT = st.lists(
    st.sampled_from(_TRICKY_CHARS) | st.characters(), min_size=1, max_size=24
).map("".join)
_LONG_TEXT = st.sampled_from(
    [
        *("a" * n for n in (64, 65, 256, 257)),  # at and past the name and metadata limits
        *("/" + "a" * n for n in (255, 300)),  # at and past a path component's limit
        "/" + "a/" * 2_100,  # past a path's limit
        "é" * 2_048,  # within the limit in characters, past it in bytes
        "🦙" * 1_100,
        "x" * 100_000,
    ]
)
_ODD_TEXT = (
    _TRICKY_TEXT
    | _LONG_TEXT
    | st.sampled_from(
        ["../../etc/passwd", "~root/.ssh", "file:///etc/passwd", "s3://b/k", "' OR 1=1 --"]
    )
)
_SCALARS = (
    _HUGE_INTS | _ODD_FLOATS | _TEXT_NUMBERS | _ODD_TEXT | st.integers() | st.booleans() | st.none()
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_ODD_TEXT, inner, max_size=4),
    max_leaves=12,
)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": [value]}
    return value


_DEEP = st.sampled_from([_nested(50), _nested(400)])


def _typed_value(annotation: Any, valid: Any) -> st.SearchStrategy[Any]:
    """A hostile value of the field's own type, likely to pass its schema and reach the
    rules, the file system and the database: where a 500 hides."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return st.sampled_from(args) | _ODD_TEXT | st.sampled_from([None, 0, True])
    kinds = {a for a in (args or (annotation,)) if a is not type(None)}
    if typing.get_origin(annotation) is dict:
        return _METADATA
    if kinds & {int, float}:
        numbers = _HUGE_INTS | st.integers() | _TEXT_NUMBERS | st.sampled_from([1.5, True])
        return (numbers | _ODD_FLOATS | st.floats()) if float in kinds else numbers
    if bool in kinds:
        return st.sampled_from([0, 1, "true", "yes", None, [], {}])
    # Text: alone, or after a valid value (a path inside the allowed roots, then a NUL).
    after_valid = (
        _ODD_TEXT.map(lambda odd: f"{valid}{odd}") if isinstance(valid, str) else _ODD_TEXT
    )
    return _ODD_TEXT | after_valid


_METADATA = st.dictionaries(
    _TRICKY_TEXT | _LONG_TEXT, _TRICKY_TEXT | _LONG_TEXT | _SCALARS, max_size=17
)


def _get(body: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        body = body.get(name) if isinstance(body, dict) else None
    return body


def _set(body: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        group = body.get(name)
        if not isinstance(group, dict):
            group = body[name] = {}
        body = group
    body[path[-1]] = value


@st.composite
def _hostile_bodies(draw: st.DrawFn, valid: dict[str, Any]) -> tuple[tuple[str, ...], Any]:
    """(the field made hostile, the body): a valid request with one field given a hostile
    value of its own type or of any other, a hostile field name, or a hostile document."""
    body = json.loads(json.dumps(valid))
    kind = draw(st.sampled_from(["typed", "typed", "typed", "metadata", "any", "key", "document"]))
    if kind in ("typed", "any"):
        path = draw(st.sampled_from(sorted(_LEAVES)))
        if kind == "typed":
            value = draw(_typed_value(_LEAVES[path], _get(body, path)))
        else:
            value = draw(_VALUES | _DEEP)
        _set(body, path, value)
        return path, body
    if kind == "metadata":
        body["metadata"] = draw(_METADATA)
        return ("metadata",), body
    if kind == "key":
        group = draw(st.sampled_from([(), *_GROUPS]))
        _set(body, (*group, draw(_ODD_TEXT)), draw(_SCALARS))
        return group, body
    return (), draw(_VALUES | _DEEP)


_RAW_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,  # deeper than Python's JSON parser recurses
    b'{"model": ' + b"9" * 5_000 + b"}",  # beyond Python's int-from-text digit limit
    b'{"model": NaN, "dataset": {"source": Infinity}}',
    b'{"model": "\\ud800", "dataset": {"source": "\\u0000"}}',
    b"\xff\xfe not UTF-8",
    b'{"model": "x", "model": "y"}',
    b"",
    b"null",
]


def _named(problems: Any, path: tuple[str, ...]) -> bool:
    """Whether a list of problems names a field for each; for a request with one broken
    field, one of them is a field of the request (the broken one, or one a rule between
    fields names: `task` set to sequence_classification is about `dataset.label_field`)."""
    if not isinstance(problems, list) or not problems:
        return False
    fields = [p.get("field") if isinstance(p, dict) else None for p in problems]
    if not all(isinstance(f, str) and f for f in fields):
        return False
    return not path or any(str(f).split(".")[0] in RunRequest.model_fields for f in fields)


def _check_create(response: Any, path: tuple[str, ...], sent: Any) -> None:
    assert response.status_code < 500, f"{response.status_code} for {sent!r:.300}: {response.text}"
    if response.status_code in (200, 201):
        RunView.model_validate(response.json())
        return
    assert response.status_code in (400, 409, 413, 422), response.text
    error = ErrorResponse.model_validate(response.json())
    if response.status_code == 422:
        assert _named(response.json()["detail"], path), f"{sent!r:.300}: {response.text}"
    else:
        assert isinstance(error.detail, str)


def _check_validate(response: Any, path: tuple[str, ...], sent: Any) -> None:
    assert response.status_code < 500, f"{response.status_code} for {sent!r:.300}: {response.text}"
    if response.status_code == 200:
        report = ValidationReport.model_validate(response.json())
        if not report.valid:
            assert _named(report.errors, path), f"{sent!r:.300}: {response.text}"
        return
    # A report covers every JSON object; only a body that is none is refused outright.
    assert response.status_code in (400, 413, 422), response.text
    ErrorResponse.model_validate(response.json())
    if response.status_code == 422:
        assert _named(response.json()["detail"], ()), response.text


def _known_hazards(annotation: Any, valid: Any) -> list[Any]:
    """The values that have broken a service like this one, for a field of this type."""
    args = typing.get_args(annotation)
    kinds = {a for a in (args or (annotation,)) if a is not type(None)}
    if typing.get_origin(annotation) is dict:
        return [{"k": "\x00"}, {"\x00": "v"}, {"k": "\ud800"}, {"\ud800": "v"}, {"k" * 65: "v"}]
    if typing.get_origin(annotation) is typing.Literal or bool in kinds:
        return ["\x00", "\ud800"]
    if float in kinds:
        return [math.nan, math.inf, 1e308, 2**64]
    if int in kinds:
        return [2**31, -(2**31) - 1, 2**63, 2**64, 10**30]
    prefix = valid if isinstance(valid, str) else "x"
    return [
        "\x00",
        "\ud800",
        f"{prefix}\x00",
        f"{prefix}\ud800",
        f"{prefix}/{'a' * 300}",  # a path component longer than the file system allows
        "x" * 100_000,
    ]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:25]}...{text[-25:]} ({len(text)} chars)"


def _post(client: TestClient, route: str, body: Any, auth: dict[str, str]) -> Any:
    # Encoded here: httpx refuses NaN and infinities, which Python's (and so the service's)
    # JSON parser reads; surrogates go as `\\ud800` escapes, as a client would send them.
    content = json.dumps(body)
    return client.post(route, content=content, headers={**auth, "Content-Type": "application/json"})


_CHECK = {"/v1/runs": _check_create, "/v1/runs/validate": _check_validate}


class TestHostileRunRequests:
    """Both databases (the conftest's `database_url` is parametrized over them)."""

    @pytest.fixture
    def valid(self, tmp_path: Path) -> dict[str, Any]:
        return run_request(tmp_path)

    @pytest.mark.parametrize("route", sorted(_CHECK))
    def test_raw_documents_are_refused_as_client_errors(
        self, client: TestClient, auth: dict[str, str], route: str
    ) -> None:
        for raw in _RAW_BODIES:
            headers = {**auth, "Content-Type": "application/json"}
            _CHECK[route](client.post(route, content=raw, headers=headers), (), raw)

    @pytest.mark.parametrize("route", sorted(_CHECK))
    def test_every_field_refuses_each_known_hazard(
        self, client: TestClient, auth: dict[str, str], valid: dict[str, Any], route: str
    ) -> None:
        """Each field, one known hazard at a time; every failure is listed, not the first."""
        failures = []
        for path, annotation in _LEAVES.items():
            for hazard in _known_hazards(annotation, _get(valid, path)):
                body = json.loads(json.dumps(valid))
                _set(body, path, hazard)
                try:
                    _CHECK[route](_post(client, route, body, auth), path, body)
                except Exception as exc:  # a failed check, or the server's own exception
                    failures.append(f"{'.'.join(path)} = {_shown(hazard)}: {exc!r:.300}")
        assert not failures, "\n".join(failures)

    @pytest.mark.parametrize("route", sorted(_CHECK))
    def test_hostile_bodies(
        self, client: TestClient, auth: dict[str, str], valid: dict[str, Any], route: str
    ) -> None:
        @_fuzz_settings(max_examples=150)
        @hypothesis.given(case=_hostile_bodies(valid))
        def post(case: tuple[tuple[str, ...], Any]) -> None:
            path, body = case
            _CHECK[route](_post(client, route, body, auth), path, body)

        post()
