"""Datasets for training: load, check the fields, tokenize, and collate without waste."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.spec import DatasetSpec

log = logging.getLogger("tuneyard.worker")

# `datasets` builder for each local file type tuneyard accepts.
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def is_local_source(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~"))


def load_raw_dataset(spec: DatasetSpec) -> Any:
    """The dataset as `datasets.Dataset`, from a local file or folder or from the hub."""
    from datasets import load_dataset

    if is_local_source(spec.source):
        path = Path(spec.source).expanduser()
        files = (
            sorted(p for p in path.iterdir() if p.suffix in LOCAL_BUILDERS)
            if path.is_dir()
            else [path]
        )
        if not files:
            raise ValueError(
                f"dataset.source {spec.source!r} holds no .jsonl, .csv or .parquet file"
            )
        builders = {LOCAL_BUILDERS.get(p.suffix) for p in files}
        if len(builders) != 1 or None in builders:
            raise ValueError(
                f"dataset.source {spec.source!r}: files must all be one of "
                f"{sorted(LOCAL_BUILDERS)}, got {sorted(p.name for p in files)}"
            )
        dataset = load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train")
    else:
        dataset = load_dataset(spec.source, spec.config, split=spec.split)

    missing = [f for f in (spec.text_field,) if f not in dataset.column_names]
    if missing:
        raise ValueError(
            f"dataset {spec.source!r} has no field {missing[0]!r} (dataset.text_field); "
            f"its fields are {dataset.column_names}"
        )
    if spec.max_samples is not None:
        dataset = dataset.select(range(min(spec.max_samples, len(dataset))))
    return dataset


def tokenize_dataset(dataset: Any, tokenizer: Any, *, text_field: str, seq_length: int) -> Any:
    """Token ids per example, truncated to seq_length; examples too short to learn from dropped."""

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        texts = [t if isinstance(t, str) else "" for t in batch[text_field]]
        encoded = tokenizer(texts, truncation=True, max_length=seq_length)
        return {"input_ids": encoded["input_ids"]}

    tokenized = dataset.map(encode, batched=True, remove_columns=dataset.column_names)
    # One token gives no next-token target: the batch would have no loss at all.
    tokenized = tokenized.filter(lambda row: len(row["input_ids"]) >= 2)
    if len(tokenized) == 0:
        raise ValueError(f"dataset has no example with at least 2 tokens in {text_field!r}")
    return tokenized


@dataclass(slots=True)
class CausalLMCollator:
    """Pads to the longest sequence in the batch, not to seq_length; padding carries no loss."""

    pad_token_id: int

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
        # Masked by position, not by token id: pad may equal eos, and eos is a real target.
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
