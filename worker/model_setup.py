"""Tokenizer, data loader, model, optimizer and scheduler for one rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from worker.data import CausalLMCollator, load_raw_dataset, tokenize_dataset
from worker.spec import RunSpec

log = logging.getLogger("tuneyard.worker")


@contextmanager
def _loading(model: str) -> Iterator[None]:
    """transformers' loading errors end in generic advice; lead with what could not load."""
    try:
        yield
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load model {model!r}: {first}") from exc


def load_tokenizer(spec: RunSpec) -> Any:
    from transformers import AutoTokenizer

    with _loading(spec.model):
        tokenizer = AutoTokenizer.from_pretrained(spec.model)
    if tokenizer.pad_token_id is None:
        # Causal LMs often ship without a pad token; padding is masked out of the loss anyway.
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {spec.model!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_dataloader(spec: RunSpec, tokenizer: Any, *, rank: int) -> Any:
    """Rank 0 loads and tokenizes first (filling the `datasets` cache); the others then
    read the cache instead of racing to write it."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    def prepare() -> Any:
        raw = load_raw_dataset(spec.dataset)
        return tokenize_dataset(
            raw, tokenizer, text_field=spec.dataset.text_field, seq_length=spec.training.seq_length
        )

    if rank == 0:
        dataset = prepare()
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        dataset = prepare()

    dp_size = spec.data_parallel_size
    dp_rank = rank // spec.deepspeed.tensor_parallel_size
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=True,
        seed=spec.training.seed,
        drop_last=True,
    )
    return DataLoader(
        dataset,
        batch_size=spec.training.batch_size_per_worker,
        sampler=sampler,
        collate_fn=CausalLMCollator(pad_token_id=tokenizer.pad_token_id),
        drop_last=True,
    )


def build_model_and_optimizer(spec: RunSpec, *, total_steps: int) -> tuple[Any, Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    with _loading(spec.model):
        model = AutoModelForCausalLM.from_pretrained(spec.model)
    if spec.training.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False

    tr = spec.training
    # No weight decay on biases and norms, as in every reference LM recipe.
    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": tr.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer: Any
    if spec.deepspeed.offload_optimizer == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, lr=tr.learning_rate, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=tr.learning_rate)
    scheduler = get_scheduler(
        tr.lr_scheduler, optimizer, num_warmup_steps=tr.warmup_steps, num_training_steps=total_steps
    )
    return model, optimizer, scheduler
