"""OWASP API7 Server Side Request Forgery: a run's model and dataset come from the hub (its
endpoint the service's configuration, not the client's), an upload or a folder inside the
allowed roots; never from a URL the client gives. A URL would have the cluster fetch from
wherever it points: the cloud's metadata service, an internal host, a bucket, a local file.

Before issue 20 the request schema took any string; only some URLs (`scheme://`) were
caught later, by the run rules, and `file:/etc/passwd` or `s3:bucket/key` passed as hub ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from contract.run_request import RunRequest
from tests.factories import run_request

URLS = [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "https://internal.example/model",
    "file:///etc/passwd",
    "file:/etc/passwd",
    "s3://bucket/model",
    "gs://bucket/data.jsonl",
    "hf://datasets/org/name",
    "HTTP://127.0.0.1:8265/api/jobs/",
]

schemes = st.from_regex(r"[a-zA-Z][a-zA-Z0-9+.-]{0,15}", fullmatch=True)
rests = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=60
)


def _refused_by_schema(body: dict[str, Any], field: str) -> str:
    with pytest.raises(ValidationError) as caught:
        RunRequest.model_validate(body)
    messages = {".".join(map(str, e["loc"])): e["msg"] for e in caught.value.errors()}
    return messages[field]


@given(scheme=schemes, slashes=st.sampled_from(["/", "//", "///"]), rest=rests)
def test_no_url_is_a_model_or_a_dataset(scheme: str, slashes: str, rest: str) -> None:
    """Whatever the scheme, host and path, a URL is refused by the schema itself: no rule
    later, and no worker, ever sees one."""
    url = f"{scheme}:{slashes}{rest}"
    for field, body in (
        ("model", {"model": url, "dataset": {"source": "/d.jsonl"}}),
        ("dataset.source", {"model": "/m", "dataset": {"source": url}}),
    ):
        assert "is a URL" in _refused_by_schema(body, field)


def test_the_api_refuses_a_url_saying_why(
    client: TestClient, auth: dict[str, str], tmp_path: Path
) -> None:
    for url in URLS:
        body = run_request(tmp_path, model=url, dataset={"source": url})
        created = client.post("/v1/runs", json=body, headers=auth)
        assert created.status_code == 422, created.text
        validated = client.post("/v1/runs/validate", json=body, headers=auth).json()
        for problems in (created.json()["detail"], validated["errors"]):
            messages = {p["field"]: p["message"] for p in problems}
            for field in ("model", "dataset.source"):
                assert "tuneyard never fetches URLs" in messages[field], messages
