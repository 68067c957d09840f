"""Prompts for GRPO (dataset.format "prompt"): tokenize each record's prompt, keep the
record for the grader, and batch prompts left-padded, as generation wants them.

A text prompt is the tokenizer's (with its special tokens), continued as it is; a prompt
given as chat messages is rendered with the chat template and the assistant's generation
prompt (worker/data/chat.py). A prompt longer than training.seq_length keeps its end: the turn
to answer is last (TRL's `max_prompt_length` truncates on the left too)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from contract.run_request import RunSpec

log = logging.getLogger("tuneyard.worker")

RECORD = "record"  # the record as JSON: what the grader reads as {{item.…}}


def tokenize_prompts(
    dataset: Any, tokenizer: Any, *, spec: RunSpec, notes: list[str] | None = None
) -> Any:
    """The prompts as a `datasets.Dataset` of `input_ids` and RECORD."""
    from contract.records import prompt_record_problem

    field = spec.dataset.prompt_field
    seq_length = spec.training.seq_length
    assert seq_length is not None  # resolved first (data/preparation.py's prepare_training)

    def encode(record: dict[str, Any], index: int) -> dict[str, Any]:
        problem = prompt_record_problem(record, prompt_field=field)
        if problem:
            raise ValueError(f"dataset record {index}: {problem}")
        ids = prompt_ids(record[field], tokenizer)
        # `default=str`: a parquet timestamp column still reaches the grader, as text.
        return {
            "input_ids": ids[-seq_length:],
            RECORD: json.dumps(dict(record), default=str),
            "cut": len(ids) > seq_length,
        }

    tokenized = dataset.map(encode, with_indices=True, remove_columns=dataset.column_names)
    cut = sum(tokenized["cut"])
    tokenized = tokenized.remove_columns("cut")
    if cut and notes is not None:
        note = (
            f"prompts: {cut} of {len(tokenized)} are longer than training.seq_length "
            f"({seq_length}) and keep their last {seq_length} tokens"
        )
        log.warning("%s", note)
        notes.append(note)
    return tokenized


def prompt_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    from worker.data.chat import render_prompt

    return list(render_prompt(prompt, tokenizer))


@dataclass(slots=True)
class PromptCollator:
    """Prompts left-padded to the longest in the batch (the completions then follow every
    prompt at the same position), and their records."""

    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, longest - n :] = torch.tensor(row["input_ids"], dtype=torch.long)
            mask[i, longest - n :] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            RECORD: [json.loads(r[RECORD]) for r in rows],
        }
