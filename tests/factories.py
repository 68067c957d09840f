"""Factories for valid requests; tests change only what they are about."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any


def local_inputs(root: Path) -> tuple[Path, Path]:
    """A model folder and a JSONL dataset under `root` (enough for request validation)."""
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data = root / "data.jsonl"
    data.write_text('{"text": "hello world"}\n{"text": "another line"}\n')
    return model, data


def run_request(root: Path, **overrides: Any) -> dict[str, Any]:
    """A valid `POST /v1/runs` body; `overrides` are merged one group deep."""
    model, data = local_inputs(root)
    body: dict[str, Any] = {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": 5,
            "learning_rate": 1e-3,
            "batch_size_per_worker": 2,
            "seq_length": 32,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2},
    }
    body = copy.deepcopy(body)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body
