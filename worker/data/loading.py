"""Datasets for training: load, check the fields, tokenize, and collate without waste."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.datasets import FILE_FORMATS, fields_read_by, is_local_source, local_split_problem
from contract.run_request import DatasetSpec
from contract.steps import examples_used
from worker.data.sources import refuse_shadowed_hub_id

log = logging.getLogger("tuneyard.worker")

# Label value that PyTorch's cross-entropy (and so every HF model) leaves out of the loss.
IGNORE_INDEX = -100


def load_raw_dataset(
    spec: DatasetSpec, *, task: str = "causal_lm", split: str | None = None
) -> Any:
    """The dataset as `datasets.Dataset`, from a local file or folder or from the hub.

    `split` defaults to `spec.split`. A local file is the split "train", and the usual
    slicing applies to it too: split "train[:90%]" with eval_split "train[90%:]".
    """
    from datasets import load_dataset

    split = split or spec.split
    if is_local_source(spec.source):
        path = Path(spec.source)
        files = (
            sorted(p for p in path.iterdir() if p.suffix.lower() in FILE_FORMATS)
            if path.is_dir()
            else [path]
        )
        if not files:
            raise ValueError(
                f"dataset.source {spec.source!r} holds no .jsonl, .csv or .parquet file"
            )
        formats = {FILE_FORMATS.get(p.suffix.lower()) for p in files}
        if len(formats) != 1 or None in formats:
            raise ValueError(
                f"dataset.source {spec.source!r}: files must all be one of "
                f"{sorted(FILE_FORMATS)}, got {sorted(p.name for p in files)}"
            )
        problem = local_split_problem("split", split)
        if problem:
            raise ValueError(problem)
        (fmt,) = formats
        assert fmt is not None
        dataset = load_dataset(fmt.builder, data_files=[str(p) for p in files], split=split)
    else:
        refuse_shadowed_hub_id("dataset.source", spec.source)
        dataset = load_dataset(spec.source, spec.config, split=split)

    for name, setting in fields_read_by(task, spec):
        if name not in dataset.column_names:
            raise ValueError(
                f"dataset {spec.source!r} has no field {name!r} ({setting}); "
                f"its fields are {dataset.column_names}"
            )
    if spec.max_samples is not None:
        dataset = dataset.select(range(examples_used(len(dataset), spec.max_samples)))
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


def _pad_right(sequences: list[list[int]], value: int, longest: int) -> torch.Tensor:
    out = torch.full((len(sequences), longest), value, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def _pad_inputs(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Input ids padded to the longest row in the batch, not to seq_length, and their mask."""
    longest = max(len(r["input_ids"]) for r in rows)
    return {
        "input_ids": _pad_right([r["input_ids"] for r in rows], pad_token_id, longest),
        "attention_mask": _pad_right([[1] * len(r["input_ids"]) for r in rows], 0, longest),
    }


@dataclass(slots=True)
class CausalLMCollator:
    """Pads to the longest sequence in the batch, not to seq_length; padding carries no loss.

    Packed rows (from pack_sequences) bring their `position_ids`, which restart at 0 with
    each example; pass the batch through `model_inputs` to the model so that it reads them.
    """

    pad_token_id: int

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        batch = _pad_inputs(rows, self.pad_token_id)
        # Padding carries no loss: masked by position, not by token id, because pad may
        # equal eos and eos is a real target. Rows with their own labels
        # (prompt_completion) already mask the prompt.
        targets = [r.get("labels", r["input_ids"]) for r in rows]
        longest = batch["input_ids"].shape[1]
        batch["labels"] = _pad_right(targets, IGNORE_INDEX, longest)
        if "position_ids" in rows[0]:
            # Packed blocks are all seq_length long; should one be shorter, each pad is a
            # one-token sequence of its own (position 0) and no real token attends to it.
            batch["position_ids"] = _pad_right([r["position_ids"] for r in rows], 0, longest)
        return batch


def model_inputs(batch: dict[str, Any], *, one_row: bool = False) -> dict[str, Any]:
    """The forward's keyword arguments for a collated batch.

    A packed batch goes without its attention_mask (all ones: a block has no padding; it
    stays in the batch for counting tokens) and with `use_cache=False`. transformers 5
    (masking_utils `_preprocess_mask_arguments`) reads packed examples from restarting
    position ids only when the attention mask is None and there is no cache, and Llama,
    GPT-2 and the like create an empty cache in forward whenever `use_cache` is on (the
    config's default). With either left in, examples would attend to one another while
    their positions restart.

    `one_row` (see `packs_in_one_row`) lays the blocks end to end as one row, each block's
    first label ignored (the row before it must not predict it): the same targets and the
    same loss, in the only layout flash-attention reads packed examples from.
    """
    if "position_ids" not in batch:
        return batch
    inputs = {k: v for k, v in batch.items() if k != "attention_mask"}
    inputs["use_cache"] = False
    if one_row:
        labels = inputs["labels"].clone()
        labels[:, 0] = IGNORE_INDEX
        inputs["labels"] = labels
        for key in ("input_ids", "labels", "position_ids"):
            inputs[key] = inputs[key].reshape(1, -1)
    return inputs


def packs_in_one_row(attn_implementation: str | None) -> bool:
    """Whether packed blocks must reach the model as one row (`model_inputs(one_row=True)`).

    flash-attention (2, 3, 4 and hub kernels) finds packed examples from position ids only
    in a batch of one row (transformers 5 modeling_flash_attention_utils
    `_is_packed_sequence`); with more rows it attends across examples. sdpa, eager and
    flex build a mask per row, where one long row would cost a mask and attention work as
    many times larger as there are rows, so they keep the rows.
    """
    return "flash" in (attn_implementation or "")


def packs_in_one_row_for(module: Any) -> bool:
    """`packs_in_one_row` for a model (or a PeftModel around one) as it was loaded."""
    config = getattr(module, "config", None)
    return packs_in_one_row(getattr(config, "_attn_implementation", None))


def tokens_in(batch: dict[str, Any]) -> int:
    """Input tokens a batch trains on, padding left out."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


@dataclass(slots=True)
class ClassificationCollator:
    """Pads to the longest sequence in the batch; one label per example."""

    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = _pad_inputs(rows, self.pad_token_id)
        batch["labels"] = torch.tensor([r["label"] for r in rows], dtype=torch.long)
        return batch


def tokenize_prompt_completion(
    dataset: Any, tokenizer: Any, *, prompt_field: str, completion_field: str, seq_length: int
) -> Any:
    """prompt + completion + eos as one sequence; only the completion (and eos) is learned."""
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        prompts = tokenizer([str(p) for p in batch[prompt_field]])["input_ids"]
        # No special tokens inside the sequence: a BOS must not land between the two parts.
        completions = tokenizer(
            [str(c) for c in batch[completion_field]], add_special_tokens=False
        )["input_ids"]
        input_ids, labels = [], []
        for prompt, completion in zip(prompts, completions, strict=True):
            target = completion + ([eos] if eos is not None else [])
            ids = (prompt + target)[:seq_length]
            input_ids.append(ids)
            labels.append(([IGNORE_INDEX] * len(prompt) + target)[:seq_length])
        return {"input_ids": input_ids, "labels": labels}

    tokenized = dataset.map(encode, batched=True, remove_columns=dataset.column_names)
    # A completion truncated away entirely leaves nothing to learn from.
    tokenized = tokenized.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"][1:]))
    if len(tokenized) == 0:
        raise ValueError(
            f"no example keeps any of {completion_field!r} within seq_length ({seq_length})"
        )
    return tokenized


def pack_sequences(tokenized: Any, *, seq_length: int, eos_token_id: int | None) -> Any:
    """Concatenate examples and cut full `seq_length` blocks: no padding. Plain text gains a
    learned eos after each example that lacks one (where a document ends is worth learning);
    rows with their own labels (prompt_completion, chat) are joined as they are, since their
    labels already say what is learned — a ChatML row ends in `<|im_end|>\n`, and an eos
    learned after it is a token the same data, unpacked, never learns.

    Each example keeps its own positions, restarting at 0 in `position_ids`, so a model fed
    through `model_inputs` attends within each example only, and its first token is no
    target (alone, nothing before it predicts it): a block's loss is its examples' losses
    as if each were alone, as transformers' DataCollatorWithFlattening makes it. Labels
    travel with their tokens, so packed prompt_completion and chat data still mask prompts.
    The last partial block is dropped, as in the Hugging Face language-modeling examples.
    """

    def pack(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        has_labels = "labels" in batch
        for i, row in enumerate(batch["input_ids"]):
            row_ids = list(row)
            row_labels = list(batch["labels"][i] if has_labels else row)
            if (
                not has_labels
                and eos_token_id is not None
                and (not row_ids or row_ids[-1] != eos_token_id)
            ):
                row_ids.append(eos_token_id)
                row_labels.append(eos_token_id)
            if row_labels:
                row_labels[0] = IGNORE_INDEX
            ids.extend(row_ids)
            labels.extend(row_labels)
            positions.extend(range(len(row_ids)))
        blocks = range(len(ids) // seq_length)
        return {
            "input_ids": [ids[b * seq_length : (b + 1) * seq_length] for b in blocks],
            "labels": [labels[b * seq_length : (b + 1) * seq_length] for b in blocks],
            "position_ids": [
                _from_zero(positions[b * seq_length : (b + 1) * seq_length]) for b in blocks
            ],
        }

    # Large map batches keep the dropped remainder small.
    packed = tokenized.map(
        pack, batched=True, batch_size=10_000, remove_columns=tokenized.column_names
    )
    # A block holding only prompt tokens has nothing to learn, and its mean loss is NaN.
    packed = packed.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"][1:]))
    if len(packed) == 0:
        raise ValueError(f"the dataset holds fewer than seq_length ({seq_length}) tokens to pack")
    return packed


def _from_zero(positions: list[int]) -> list[int]:
    """A block's positions with the example cut at its start counted from 0 there too.

    flash-attention's varlen path (modeling_flash_attention_utils) takes every position 0
    as a sequence start, so each sequence must start at 0; it also keeps every position
    below seq_length, within a model's learned position embeddings (GPT-2's `wpe`).
    """
    offset = positions[0]
    if offset == 0:
        return positions
    restart = positions.index(0) if 0 in positions else len(positions)
    return [p - offset for p in positions[:restart]] + positions[restart:]


def label_ids(dataset: Any, label_field: str) -> list[Any]:
    """The label values in id order: integers as they are, other values sorted."""
    values = set(dataset.unique(label_field))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise ValueError(f"integer labels in {label_field!r} must be >= 0")
        return list(range(max(values) + 1))
    return sorted(values, key=str)


def tokenize_classification(
    dataset: Any,
    tokenizer: Any,
    *,
    text_field: str,
    text_pair_field: str | None,
    label_field: str,
    labels: list[Any],
    seq_length: int,
) -> Any:
    index = {value: i for i, value in enumerate(labels)}

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        texts = [str(t) for t in batch[text_field]]
        pairs = [str(t) for t in batch[text_pair_field]] if text_pair_field else None
        encoded = tokenizer(texts, pairs, truncation=True, max_length=seq_length)
        unknown = [v for v in batch[label_field] if v not in index]
        if unknown:
            raise ValueError(f"label {unknown[0]!r} in {label_field!r} is not a training label")
        return {"input_ids": encoded["input_ids"], "label": [index[v] for v in batch[label_field]]}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names)
