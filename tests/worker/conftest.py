"""Fixtures and helpers shared by the worker's data tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's `datasets` cache in its own folder, not the user's home."""
    import datasets

    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny GPT-2 tokenizer: like GPT-2's, it adds no special token of its own."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def in_memory_dataset(columns: dict[str, list[Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict(columns)
