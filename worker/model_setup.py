"""Tokenizer, data loaders, model, optimizer and scheduler for one rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from contract.run_request import RunSpec
from contract.seq_length import (
    choice_note,
    chosen_seq_length,
    completion_room,
    seq_length_cap,
)
from worker.data import (
    CausalLMCollator,
    ClassificationCollator,
    label_ids,
    load_raw_dataset,
    pack_sequences,
    tokenize_classification,
    tokenize_dataset,
    tokenize_prompt_completion,
)
from worker.lora import apply_lora
from worker.sources import refuse_shadowed_hub_id

log = logging.getLogger("tuneyard.worker")


@contextmanager
def _loading(model: str) -> Iterator[None]:
    """transformers' loading errors end in generic advice; lead with what could not load."""
    refuse_shadowed_hub_id("model", model)
    try:
        yield
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load model {model!r}: {first}") from exc


def load_tokenizer(spec: RunSpec) -> Any:
    from transformers import AutoTokenizer

    with _loading(spec.model):
        tokenizer = AutoTokenizer.from_pretrained(spec.model)
    if spec.dataset.chat_template is not None:
        # The request's template wins over the model's own, and is exported with it.
        tokenizer.chat_template = spec.dataset.chat_template
    if tokenizer.pad_token_id is None:
        # Causal LMs often ship without a pad token; padding is masked out of the loss anyway.
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {spec.model!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
        from worker.preference import tokenize_preference

        return tokenize_preference(raw, tokenizer, spec=spec, notes=notes), None
    if ds.format == "prompt":
        from worker.prompts import tokenize_prompts

        return tokenize_prompts(raw, tokenizer, spec=spec, notes=notes), None
    if ds.format == "chat":
        from worker.chat import tokenize_chat

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

    with _loading(spec.model):
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
    from worker.preference import collator_for
    from worker.prompts import PromptCollator

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


@dataclass(slots=True)
class LoadedModel:
    module: Any
    # ZeRO-3: transformers' HfDeepSpeedConfig. transformers finds it through a weak
    # reference (`is_deepspeed_zero3_enabled`), so it must outlive the model: with it,
    # `from_pretrained` builds the model inside `deepspeed.zero.Init` (each rank holds its
    # partition only, and only rank 0 reads the checkpoint), and later calls such as
    # resizing embeddings gather partitioned weights instead of reading empty ones.
    zero3_config: Any = None


@contextmanager
def loading_whole(zero3_config: Any) -> Iterator[None]:
    """`from_pretrained` of a whole model on one rank (the export check) while a run's
    ZeRO-3 config is alive: without this, transformers would create it inside zero.Init,
    a collective the other ranks never join."""
    if zero3_config is None:
        yield
        return
    from transformers.integrations.deepspeed import (
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(zero3_config)


def build_model(
    spec: RunSpec,
    tokenizer: Any,
    labels: list[Any] | None,
    *,
    ds_config: dict[str, Any],
    precision: str,
) -> LoadedModel:
    """The model in the dtype it trains in, partitioned as it is created under ZeRO-3.

    transformers 5 loads in the checkpoint's own dtype by default (`dtype="auto"`): a bf16
    checkpoint would train in bf16 under `precision: fp32` and export bf16. The dtype is
    always given, so fp32 means fp32 and a 16-bit run never holds an fp32 copy at load.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from contract.deepspeed_config import torch_dtype_name

    zero3_config = None
    # AutoTP + ZeRO-3 still loads whole on each rank: transformers 5 refuses to load into
    # zero.Init when the config asks for tensor parallelism ("Weight conversions ... with
    # DeepSpeed Tensor Parallelism are not yet implemented", integrations/deepspeed.py),
    # and AutoTP shards whole weights in deepspeed.initialize.
    if ds_config["zero_optimization"]["stage"] == 3 and "tensor_parallel" not in ds_config:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        # zero.Init reads the world size from DeepSpeed's own communication backend, which
        # `deepspeed.initialize` would start only later; started now, it wraps the process
        # group Ray Train made (without it zero.Init sees a world of 1 and refuses the
        # batch sizes).
        deepspeed.init_distributed(verbose=False)
        zero3_config = HfDeepSpeedConfig(ds_config)
    dtype = getattr(torch, torch_dtype_name(precision))
    with _loading(spec.model):
        if spec.task == "sequence_classification":
            assert labels is not None
            model = AutoModelForSequenceClassification.from_pretrained(
                spec.model,
                dtype=dtype,
                num_labels=len(labels),
                id2label={i: str(v) for i, v in enumerate(labels)},
                label2id={str(v): i for i, v in enumerate(labels)},
            )
            # Models without a pad token (GPT-2) cannot find the last token of a padded row.
            model.config.pad_token_id = tokenizer.pad_token_id
        else:
            model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype)
    if spec.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model = apply_lora(model, spec)
    return LoadedModel(module=model, zero3_config=zero3_config)


def optimizer_groups(model: Any, *, weight_decay: float, all_decay: bool) -> list[dict[str, Any]]:
    """No weight decay on biases and norms, as in the reference LM recipes, unless asked.

    One group where nothing needs keeping apart: ZeRO partitions, reduces and gathers each
    group on its own, a fixed cost per step that shows on small models."""
    params = [p for p in model.parameters() if p.requires_grad]
    if all_decay or weight_decay == 0:
        return [{"params": params, "weight_decay": weight_decay}]
    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            # A parameter partitioned by zero.Init is an empty 1-d tensor; ds_shape is its
            # real shape.
            ndim = len(getattr(param, "ds_shape", param.shape))
            (no_decay if ndim < 2 or "norm" in name.lower() else decay).append(param)
    # Never an empty group: a LoRA model's trainable parameters are all matrices, and an
    # empty group is dropped by DeepSpeed's wrapper, leaving the scheduler built over more
    # groups than the optimizer it steps has (torch's `_update_lr` then fails at step 1).
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_optimizer(spec: RunSpec, model: Any, *, total_steps: int) -> tuple[Any, Any]:
    import torch
    from transformers import get_scheduler

    tr = spec.training
    groups = optimizer_groups(model, weight_decay=tr.weight_decay, all_decay=tr.decay_bias_and_norm)
    optimizer: Any
    if spec.deepspeed.offload_optimizer == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, lr=tr.learning_rate, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=tr.learning_rate)
    scheduler = get_scheduler(
        tr.lr_scheduler, optimizer, num_warmup_steps=tr.warmup_steps, num_training_steps=total_steps
    )
    return optimizer, scheduler
