"""The tokenizer and the model of a run, loaded in the dtype it trains in (partitioned as
it is created under ZeRO-3)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from contract.run_request import RunSpec
from worker.data.sources import loading_errors
from worker.model.lora import apply_lora


def load_tokenizer(spec: RunSpec) -> Any:
    from transformers import AutoTokenizer

    with loading_errors(spec.model):
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
    with loading_errors(spec.model):
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
