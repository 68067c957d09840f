"""Assertions shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.e2e.conftest import Service


def assert_succeeded(service: Service, run: dict[str, Any]) -> None:
    assert run["status"] == "succeeded", (run["error"], service.log_path.read_text()[-2000:])


def metric_series(service: Service, run_id: str, name: str) -> dict[int, float]:
    page = service.http.get(f"/v1/runs/{run_id}/metrics", params={"name": name}).json()
    return {m["step"]: m["value"] for m in page["data"]}


def checkpoints(service: Service, run_id: str, kind: str) -> list[dict[str, Any]]:
    data = service.http.get(f"/v1/runs/{run_id}/checkpoints").json()["data"]
    return [c for c in data if c["kind"] == kind]


def assert_export_matches_engine(run: dict[str, Any], *, auto: Any) -> Any:
    """Load the export as a user would and compare its logits with the trained engine's
    top logits on the probe row the worker saved; returns the loaded model."""
    export = Path(run["output"]["model_path"])
    probe = torch.load(export.parent / "export_check.pt", weights_only=True)
    assert "logits" not in probe  # the check keeps the top few per position, never all
    assert probe["input_ids"].shape[0] == 1 and probe["input_ids"].shape[1] <= 128
    model = auto.from_pretrained(export).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    at_top = logits.float().gather(-1, probe["top_ids"])
    diff = (at_top - probe["top_logits"]).abs()
    if logits.dim() == 3:
        diff = diff[probe["attention_mask"].bool()]
    assert float(diff.max()) <= 1e-3 * float(probe["top_logits"].abs().max()), float(diff.max())
    return model
