"""`POST /v1/runs/validate` counts what the worker will train on where the request cannot
say it alone: packed data (its rows depend on the token count) and an unset seq_length
(chosen from the data). The numbers are the worker's own: the same preparation runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.services import data_plan
from contract.run_request import RunSpec
from contract.steps import StepPlan
from tests.factories import run_request
from worker.data.preparation import prepare_examples, prepare_training
from worker.model.loading import load_tokenizer

WORDS = [
    "the",
    "market",
    "rose",
    "as",
    "rain",
    "fell",
    "on",
    "the",
    "old",
    "town",
    "while",
    "teams",
    "played",
    "late",
]


def _news(path: Path, rows: int, *, longest: int = 34) -> Path:
    lines = [
        {"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5 + (i * 7) % (longest - 4)))}
        for i in range(rows)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _body(tmp_path: Path, model: Path, data: Path, **training: Any) -> dict[str, Any]:
    body = run_request(tmp_path, model=str(model), dataset={"source": str(data)})
    body["training"] = {"epochs": 2, "batch_size_per_worker": 2, **training}
    return body


def _workers_count(body: dict[str, Any]) -> tuple[int, int]:
    """(total steps, seq_length) as the worker computes them for this request."""
    spec = RunSpec.for_attempt(
        {k: v for k, v in body.items() if k != "metadata"},
        run_id="run_x",
        attempt=1,
        storage_path="/unused",
    )
    tokenizer = load_tokenizer(spec)
    # The length prepare_training chooses; the rows, from a fresh pass at it.
    spec, _, _ = prepare_training(spec, tokenizer, notes=[])
    examples, _ = prepare_examples(spec, tokenizer, split=None, notes=[])
    assert spec.training.seq_length is not None
    return StepPlan.for_examples(spec, examples=len(examples)).total_steps, spec.training.seq_length


def test_packed_steps_are_the_workers_and_a_second_validate_is_cached(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _news(tmp_path / "news.jsonl", 60)
    body = _body(tmp_path, tiny_model_dir, data, packing=True, seq_length=32)
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert report["valid"], report
    steps, _ = _workers_count(body)
    assert report["resolved"]["total_steps"] == steps > 0
    assert report["resolved"]["steps_per_epoch"] == steps // 2

    def no_second_count(spec: dict[str, Any]) -> data_plan.DataPlan:
        raise AssertionError("counted again: the cache missed")

    monkeypatch.setattr(data_plan, "_run_worker_plan", no_second_count)
    again = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert again["resolved"]["total_steps"] == steps


def test_an_unset_seq_length_is_predicted_as_the_worker_chooses_it(
    client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    # The tiny GPT-2 has 128 positions, fewer than the old fixed default of 512.
    data = _news(tmp_path / "news.jsonl", 20, longest=8)
    body = _body(tmp_path, tiny_model_dir, data)
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert report["valid"], report
    steps, chosen = _workers_count(body)
    assert report["resolved"]["seq_length"] == chosen == 64
    assert report["resolved"]["total_steps"] == steps
    assert any("chose 64" in note for note in report["resolved"]["data_notes"])
    assert report["estimate"]["tokens_per_step"] == report["resolved"]["global_batch_size"] * 64
    created = client.post("/v1/runs", json=body, headers=auth)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["training"]["seq_length"] is None  # the worker chooses


def test_a_hub_dataset_is_counted_on_the_cluster_with_the_reason(
    client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    body = _body(tmp_path, tiny_model_dir, tmp_path, packing=True, seq_length=32)
    body["dataset"] = {"source": "ag_news", "text_field": "text"}
    resolved = client.post("/v1/runs/validate", json=body, headers=auth).json()["resolved"]
    assert resolved["total_steps"] is None
    assert "cluster" in resolved["data_unknown_because"]
