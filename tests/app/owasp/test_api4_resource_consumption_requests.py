"""OWASP API4 Unrestricted Resource Consumption, run requests: every string and list of a
run request has a length, every number a ceiling, and integers stay below 2**31 (the
database's INTEGER). Before issue 20 a 40 MiB `model` string was stored, and steps or
seeds of any size were accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.storage.models import Run
from tests.factories import run_request

BIG_NUMBERS = [2**31, 2**63, 10**30]


def _refused(
    client: TestClient,
    auth: dict[str, str],
    body: dict[str, Any],
    session_factory: sessionmaker[Session],
) -> dict[str, str]:
    response = client.post("/v1/runs", json=body, headers=auth)
    assert response.status_code == 422, response.text
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 0
    return {p["field"]: p["message"] for p in response.json()["detail"]}


INTEGERS = {
    "training": ["max_steps", "epochs", "warmup_steps", "seed", "log_every_n_steps"],
    "dataset": ["max_samples"],
    "checkpointing": ["every_n_steps", "keep_last"],
    "deepspeed": ["tensor_parallel_size"],
    "resources": ["gpus_per_worker", "cpus_per_worker", "num_workers"],
}


@pytest.mark.parametrize("value", BIG_NUMBERS)
def test_integers_past_the_databases_integer_are_refused_naming_each_field(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    value: int,
) -> None:
    body = run_request(tmp_path)
    for group, names in INTEGERS.items():
        body[group] = {**body.get(group, {}), **dict.fromkeys(names, value)}
    body["training"]["eval_every_n_steps"] = value
    body["resources"]["use_gpu"] = True
    problems = _refused(client, auth, body, session_factory)
    for group, names in INTEGERS.items():
        for name in names:
            assert "less than or equal to" in problems[f"{group}.{name}"], problems


@pytest.mark.parametrize(
    ("group", "name", "value"),
    [
        ("training", "weight_decay", 1e6),
        ("training", "max_grad_norm", 1e300),
    ],
)
def test_rates_have_ceilings(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    group: str,
    name: str,
    value: float,
) -> None:
    problems = _refused(
        client, auth, run_request(tmp_path, **{group: {name: value}}), session_factory
    )
    assert f"{group}.{name}" in problems


def test_strings_have_lengths(
    client: TestClient, auth: dict[str, str], tmp_path: Path, session_factory: sessionmaker[Session]
) -> None:
    body = run_request(tmp_path, model="/" + "m/" * 4096)
    names = ["split", "config", "text_field", "label_field", "eval_split", "prompt_field"]
    body["dataset"] = {"source": "/" + "d/" * 4096, **{name: "n" * 1000 for name in names}}
    problems = _refused(client, auth, body, session_factory)
    assert problems["model"] == "String should have at most 4095 characters"
    assert problems["dataset.source"] == "String should have at most 4095 characters"
    for name in names:
        assert problems[f"dataset.{name}"] == "String should have at most 256 characters"


def test_a_megabyte_model_string_is_refused_and_not_echoed(
    client: TestClient, auth: dict[str, str], tmp_path: Path, session_factory: sessionmaker[Session]
) -> None:
    body = run_request(tmp_path, model="gpt2" + "x" * (1 << 20))
    response = client.post("/v1/runs", json=body, headers=auth)
    assert response.status_code == 422
    assert len(response.content) < 2_000
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 0


@pytest.mark.parametrize("metadata", [{"team": "a\x00b"}, {"te\x00am": "a"}])
def test_metadata_is_storable(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    session_factory: sessionmaker[Session],
    metadata: dict[str, str],
) -> None:
    # PostgreSQL's json ->> cannot read a stored \u0000: it broke every later filter.
    # (Lengths and counts were bounded before: tests/app/rules/test_run_rules.py.)
    problems = _refused(client, auth, run_request(tmp_path, metadata=metadata), session_factory)
    assert any(field.startswith("metadata") and "NUL" in m for field, m in problems.items())
