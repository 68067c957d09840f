"""A rank's training and evaluation data: tokenized (chat, preference, prompt, text or
classification examples), packed where the run asks, at a seq_length chosen from the data
where the request left it unset, and in the data loaders of its data-parallel shard."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from contract.run_request import RunSpec
from contract.seq_length import (
    choice_note,
    chosen_seq_length,
    completion_room,
    seq_length_cap,
)
from worker.data.loading import (
    CausalLMCollator,
    ClassificationCollator,
    label_ids,
    load_raw_dataset,
    pack_sequences,
    tokenize_classification,
    tokenize_dataset,
    tokenize_prompt_completion,
)
from worker.data.sources import loading_errors

log = logging.getLogger("tuneyard.worker")


@dataclass(slots=True)
class Data:
    train: Any
    eval: Any | None
    labels: list[Any] | None  # classification: label values in id order
    # What preparing the data changed (conversations truncated, pairs dropped): run events.
    notes: list[str]


def prepare_examples(
    spec: RunSpec,
    tokenizer: Any,
    *,
    split: str | None,
    labels: list[Any] | None = None,
    notes: list[str] | None = None,
    source: str | None = None,
) -> tuple[Any, Any]:
    """Tokenized examples for one split (of `source`, when given, in place of
    dataset.source), packed where the run asks, and the label values (classification
    only); what fitting chat or preference data into seq_length cost is added to `notes`.

    `labels` fixes the label ids (the train split's), so an eval split with fewer distinct
    labels still maps each label to the id the model learned for it.
    """
    examples, labels = _tokenized(
        spec, tokenizer, split=split, labels=labels, notes=notes, source=source
    )
    return _packed(spec, tokenizer, examples), labels


def _tokenized(
    spec: RunSpec,
    tokenizer: Any,
    *,
    split: str | None,
    labels: list[Any] | None = None,
    notes: list[str] | None = None,
    source: str | None = None,
) -> tuple[Any, Any]:
    """`prepare_examples` but the packing."""
    ds, tr = spec.dataset, spec.training
    # prepare_training resolves an unset one first (build_data, worker/data_plan.py).
    assert tr.seq_length is not None, "seq_length must be resolved (prepare_training)"
    if source is not None:
        # Another file's examples are all evaluated: max_samples limits training data.
        ds = ds.model_copy(update={"source": source, "config": None, "max_samples": None})
    raw = load_raw_dataset(ds, task=spec.task, split=split)
    if spec.task == "sequence_classification":
        field = ds.label_field or "label"
        if labels is None:
            labels = label_ids(raw, field)
        examples = tokenize_classification(
            raw,
            tokenizer,
            text_field=ds.text_field,
            text_pair_field=ds.text_pair_field,
            label_field=field,
            labels=labels,
            seq_length=tr.seq_length,
        )
        return examples, labels
    if ds.format == "preference":
        from worker.data.preference import tokenize_preference

        return tokenize_preference(raw, tokenizer, spec=spec, notes=notes), None
    if ds.format == "prompt":
        from worker.data.prompts import tokenize_prompts

        return tokenize_prompts(raw, tokenizer, spec=spec, notes=notes), None
    if ds.format == "chat":
        from worker.data.chat import tokenize_chat

        return tokenize_chat(raw, tokenizer, spec=spec, notes=notes), None
    if ds.format == "prompt_completion":
        examples = tokenize_prompt_completion(
            raw,
            tokenizer,
            prompt_field=ds.prompt_field,
            completion_field=ds.completion_field,
            seq_length=tr.seq_length,
        )
        return examples, None
    examples = tokenize_dataset(raw, tokenizer, text_field=ds.text_field, seq_length=tr.seq_length)
    return examples, None


def _packed(spec: RunSpec, tokenizer: Any, examples: Any) -> Any:
    """Causal-LM rows (text, prompt/completion, chat) in seq_length blocks where the run
    asks; classification and preference examples are never packed."""
    tr = spec.training
    if not tr.packing or spec.task == "sequence_classification":
        return examples
    if spec.dataset.format == "preference":
        return examples
    assert tr.seq_length is not None
    return pack_sequences(examples, seq_length=tr.seq_length, eos_token_id=tokenizer.eos_token_id)


def prepare_training(
    spec: RunSpec, tokenizer: Any, *, notes: list[str]
) -> tuple[RunSpec, Any, Any]:
    """The training split's examples and label values (`prepare_examples`), and the spec
    they were prepared at: with training.seq_length chosen from the data first where the
    request left it unset (contract/seq_length.py), and a note saying what was chosen.

    To choose, the data is tokenized at the cap + 1 (the model's maximum positions),
    unpacked, which shows the longest example and how many the cap truncates. Where that
    cut nothing and noted nothing, those rows are the rows a pass at the chosen length
    gives, and they are kept (packed where asked): the data is tokenized once."""
    if spec.training.seq_length is not None:
        examples, labels = prepare_examples(spec, tokenizer, split=None, notes=notes)
        return spec, examples, labels
    from transformers import AutoConfig

    with loading_errors(spec.model):
        config = AutoConfig.from_pretrained(spec.model).to_dict()
    # Method grpo: the prompt's share of the positions, the completion's left free.
    cap = seq_length_cap(config) - completion_room(spec)
    if cap < 2:
        raise ValueError(
            f"method.max_completion_tokens ({completion_room(spec)}) leaves no room for a "
            f"prompt in the model's {seq_length_cap(config)} positions"
        )
    probe_notes: list[str] = []
    examples, labels = _tokenized(
        _at_seq_length(spec, cap + 1), tokenizer, split=None, notes=probe_notes
    )
    columns = [name for name in examples.column_names if name.endswith("input_ids")]
    lengths = [
        max(len(ids) for ids in row)
        for row in zip(*(examples[name] for name in columns), strict=True)
    ]
    longest = max(lengths, default=0)
    chosen = chosen_seq_length(longest, cap)
    truncated = sum(1 for n in lengths if n > chosen)
    note = choice_note(
        chosen=chosen,
        longest=longest,
        cap=cap,
        truncated=truncated,
        examples=len(lengths),
        room=completion_room(spec),
    )
    log.info(note)
    notes.append(note)
    resolved = _at_seq_length(spec, chosen)
    if truncated or probe_notes:
        # Rows cut at cap + 1, or notes that name that length: prepared again at the one
        # chosen.
        examples, labels = prepare_examples(resolved, tokenizer, split=None, notes=notes)
        return resolved, examples, labels
    return resolved, _packed(resolved, tokenizer, examples), labels


def _at_seq_length(spec: RunSpec, seq_length: int) -> RunSpec:
    training = spec.training.model_copy(update={"seq_length": seq_length})
    return spec.model_copy(update={"training": training})


def build_data(spec: RunSpec, tokenizer: Any, *, rank: int) -> Data:
    """Rank 0 loads and tokenizes first (filling the `datasets` cache); the others then
    read the cache instead of racing to write it."""
    import torch.distributed as dist

    notes: list[str] = []

    def prepare() -> tuple[Any, Any, Any]:
        # Every rank prepares the same data: rank 0's notes are the run's.
        notes.clear()
        resolved, train, labels = prepare_training(spec, tokenizer, notes=notes)
        evaluation = None
        if wanted := spec.dataset.eval_wanted():
            eval_source, eval_split = wanted
            # The train split's label ids; a label only the eval split has is refused by
            # tokenize_classification, naming it.
            eval_notes: list[str] = []
            evaluation, _ = prepare_examples(
                resolved,
                tokenizer,
                split=eval_split,
                labels=labels,
                notes=eval_notes,
                source=eval_source,
            )
            notes.extend(f"evaluation data: {n}" for n in eval_notes)
        return train, evaluation, labels

    if rank == 0:
        train, evaluation, labels = prepare()
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        train, evaluation, labels = prepare()
    return Data(
        train=_loader(spec, tokenizer, train, shuffle=True),
        eval=_loader(spec, tokenizer, evaluation, shuffle=False) if evaluation else None,
        labels=labels,
        notes=notes,
    )


def _loader(spec: RunSpec, tokenizer: Any, examples: Any, *, shuffle: bool) -> Any:
    # Sharded by data-parallel rank: the ranks of one tensor-parallel group (consecutive
    # ranks, as DeepSpeed lays out its mesh) see the same batch, as AutoTP requires.
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    rank = dist.get_rank() if dist.is_initialized() else 0
    tp = spec.deepspeed.tensor_parallel_size
    sampler: DistributedSampler[Any] = DistributedSampler(
        examples,
        num_replicas=spec.data_parallel_size,
        rank=rank // tp,
        shuffle=shuffle,
        seed=spec.training.seed,
        # Training drops the ragged end; evaluation pads it so every rank runs as many
        # forward passes (ZeRO-3 and AutoTP forwards are collective).
        drop_last=shuffle,
    )
    from worker.data.preference import collator_for
    from worker.data.prompts import PromptCollator

    collate: Any = collator_for(spec, tokenizer) or (
        ClassificationCollator(pad_token_id=tokenizer.pad_token_id)
        if spec.task == "sequence_classification"
        else PromptCollator(pad_token_id=tokenizer.pad_token_id)
        if spec.dataset.format == "prompt"
        else CausalLMCollator(pad_token_id=tokenizer.pad_token_id)
    )
    return DataLoader(
        examples,
        batch_size=spec.training.batch_size_per_worker,
        sampler=sampler,
        collate_fn=collate,
        drop_last=shuffle,
        # Page-locked batches copy to the GPU asynchronously (`.to(device, non_blocking=True)`).
        pin_memory=spec.resources.use_gpu,
    )
