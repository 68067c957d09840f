"""What `tuneyard demo` submits passes the service's validation, offline and with --hub."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from app.cli.demo import HUB_DATASET, HUB_MODEL, demo_request
from app.cli.tiny_assets import write_jsonl_dataset


def test_offline_demo_request_is_valid(
    client: TestClient, auth: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl_dataset(tmp_path / "news.jsonl", rows=20)
    body = demo_request(
        model=str(tiny_model_dir), dataset={"source": str(data), "text_field": "text"}, steps=30
    )
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert report["valid"], report["errors"]
    assert report["resolved"]["total_steps"] == 30


def test_hub_demo_request_is_valid(client: TestClient, auth: dict[str, str]) -> None:
    body = demo_request(model=HUB_MODEL, dataset=HUB_DATASET, steps=30)
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert report["valid"], report["errors"]
    assert report["resolved"]["deepspeed_config"]["zero_optimization"]["stage"] == 2
