"""Preference pairs for DPO: tokenize `prompt` / `chosen` / `rejected` records, and batch
them as the policy's one forward over both answers wants them.

Each pair becomes two sequences, prompt + chosen and prompt + rejected, the prompt masked
out of the labels. Text prompts are the tokenizer's (with its special tokens) and the
answer follows without any, then eos: the same layout as format prompt_completion. A prompt
given as chat messages is rendered with the chat template (worker/data/chat.py), each answer as
the assistant's reply to it.

TRL 1.16's DPOTrainer differs in one way for text records: it tokenizes prompt + answer +
eos as one string and takes the answer from where the result leaves the tokenized prompt,
so a token that merges across the boundary goes to the answer. Here the parts are
tokenized apart, as prompt_completion does and as a model sees a prompt it answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from contract.run_request import RunSpec
from worker.data.loading import IGNORE_INDEX, _pad_right

log = logging.getLogger("tuneyard.worker")

COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def tokenize_preference(
    dataset: Any, tokenizer: Any, *, spec: RunSpec, notes: list[str] | None = None
) -> Any:
    """The pairs as a `datasets.Dataset` with COLUMNS; pairs that seq_length leaves an
    answer without a single learned token are dropped (counted in the log and, with
    `notes`, in a note for the run's events)."""
    from contract.records import preference_record_problem

    ds = spec.dataset
    seq_length = spec.training.seq_length
    assert seq_length is not None  # resolved first (data/preparation.py's prepare_training)

    def encode(record: dict[str, Any], index: int) -> dict[str, list[int]]:
        problem = preference_record_problem(
            record,
            prompt_field=ds.prompt_field,
            chosen_field=ds.chosen_field,
            rejected_field=ds.rejected_field,
        )
        if problem:
            raise ValueError(f"dataset record {index}: {problem}")
        prompt = record[ds.prompt_field]
        out: dict[str, list[int]] = {}
        for side, field in (("chosen", ds.chosen_field), ("rejected", ds.rejected_field)):
            prompt_ids, answer_ids = _prompt_and_answer(prompt, record[field], tokenizer)
            out[f"{side}_input_ids"] = (prompt_ids + answer_ids)[:seq_length]
            out[f"{side}_labels"] = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:seq_length]
        return out

    tokenized = dataset.map(encode, with_indices=True, remove_columns=dataset.column_names)
    kept = tokenized.filter(
        lambda row: _learns(row["chosen_labels"]) and _learns(row["rejected_labels"])
    )
    dropped = len(tokenized) - len(kept)
    if dropped:
        note = (
            f"preference data: {dropped} of {len(tokenized)} pairs dropped: "
            f"training.seq_length ({seq_length}) cuts a whole answer"
        )
        log.warning("%s", note)
        if notes is not None:
            notes.append(note)
    if len(kept) == 0:
        raise ValueError(
            f"no preference pair keeps any of its {ds.chosen_field!r} and {ds.rejected_field!r} "
            f"answers within training.seq_length ({seq_length}): raise it or shorten the prompts"
        )
    return kept


def _prompt_and_answer(prompt: Any, answer: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    from contract.records import answer_text

    text = answer_text(answer)
    if isinstance(prompt, str):
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        # No special tokens inside the sequence: a BOS must not land between the parts.
        answer_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        eos = tokenizer.eos_token_id
        # An answer that ends with eos already gets no second one (TRL's add_eos).
        ends = eos is None or (answer_ids and answer_ids[-1] == eos)
        return prompt_ids, answer_ids + ([] if ends else [eos])
    from worker.data.chat import render_assistant_reply, render_prompt

    return list(render_prompt(prompt, tokenizer)), list(
        render_assistant_reply(prompt, text, tokenizer)
    )


def _learns(labels: list[int]) -> bool:
    # The first position is never a target: nothing predicts it.
    return any(t != IGNORE_INDEX for t in labels[1:])


@dataclass(slots=True)
class PreferenceCollator:
    """B pairs as one batch of 2B rows, the chosen rows first, padded to the longest row:
    the policy scores both answers in one forward (as TRL does), and the batch has the
    keys of a causal-LM batch, so what reads the first batch (the export probe) works
    unchanged."""

    pad_token_id: int

    def __call__(self, pairs: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        ids = [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
        labels = [p["chosen_labels"] for p in pairs] + [p["rejected_labels"] for p in pairs]
        longest = max(len(row) for row in ids)
        return {
            "input_ids": _pad_right(ids, self.pad_token_id, longest),
            "attention_mask": _pad_right([[1] * len(row) for row in ids], 0, longest),
            "labels": _pad_right(labels, IGNORE_INDEX, longest),
        }


def collator_for(spec: RunSpec, tokenizer: Any) -> PreferenceCollator | None:
    """The collator for format preference, or None where the usual ones apply."""
    if spec.dataset.format != "preference":
        return None
    return PreferenceCollator(pad_token_id=tokenizer.pad_token_id)
