"""LoRA adapters (peft) on the loaded model, and the adapter and merged exports of a LoRA run.

Under ZeRO-3 the base model was created inside `deepspeed.zero.Init`, its weights already
partitioned. peft 0.21.2 sizes each adapter from the wrapped layer's `in_features` and
`out_features` (tuners_utils._get_in_out_features; for a Conv1D it reads `ds_shape`), never
from the empty partitioned tensor, and `deepspeed.initialize` partitions the new adapter
parameters, created outside zero.Init (parameter_offload._convert_to_zero_parameters:
each is broadcast from rank 0, then partitioned; its dtype is kept as it is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.run_request import RunSpec


def lora_config(spec: RunSpec) -> Any:
    from peft import LoraConfig, TaskType

    assert spec.lora is not None
    lora = spec.lora
    return LoraConfig(
        r=lora.r,
        # Typed int in peft, used only as alpha / r: a fractional alpha works as asked.
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=(
            TaskType.SEQ_CLS if spec.task == "sequence_classification" else TaskType.CAUSAL_LM
        ),
    )


def apply_lora(model: Any, spec: RunSpec) -> Any:
    """The model wrapped in peft's LoRA when the run asks for adapters, else unchanged."""
    if spec.lora is None:
        return model
    from peft import get_peft_model

    if spec.training.gradient_checkpointing:
        # The embeddings are frozen: without this their output needs no grad, and a
        # checkpointed layer's recomputation would have no graph to backpropagate into.
        model.enable_input_require_grads()
    # Adapters in the base weights' dtype, not peft's default fp32 upcast: DeepSpeed
    # flattens each parameter group into one buffer of the trained dtype (ZeRO-3 converts
    # the new parameters without casting them) and keeps its own fp32 master copy.
    return get_peft_model(model, lora_config(spec), autocast_adapter_dtype=False)


def save_adapter(module: Any, state: dict[str, Any], out: Path, *, spec: RunSpec) -> None:
    """adapter_config.json and adapter_model.safetensors: the LoRA weights picked out of
    the full (gathered) state dict of the PeftModel, by peft itself."""
    module.save_pretrained(out, state_dict=state, safe_serialization=True)
    _name_base_model(out, spec.given_model)


def _name_base_model(out: Path, model: str) -> None:
    """peft writes the base's `name_or_path` as loaded, which is the run's `model` unless
    transformers rewrote it; the adapter's users load it by the name the run was given."""
    import json

    path = out / "adapter_config.json"
    config = json.loads(path.read_text())
    if config.get("base_model_name_or_path") != model:
        config["base_model_name_or_path"] = model
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def merged_model(module: Any, state: dict[str, Any], spec: RunSpec, *, dtype: Any) -> Any:
    """A plain transformers model with the trained adapters folded into its weights.

    A fresh copy of the PeftModel's structure in fp32 takes the trained state, then peft
    merges W + (alpha / r) B A in fp32 and the result is cast to the trained dtype: a
    16-bit merge would round the small update into the base weight's own rounding error.
    Rank 0 holds the whole model in fp32 here (host memory, 4 bytes per parameter)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = (
        AutoModelForSequenceClassification
        if spec.task == "sequence_classification"
        else AutoModelForCausalLM
    )
    base_config = module.get_base_model().config
    with torch.device("cpu"):
        base = auto.from_config(base_config, dtype=torch.float32)
    fresh = get_peft_model(base, lora_config(spec), autocast_adapter_dtype=False)
    missing, unexpected = fresh.load_state_dict(
        {k: v.float() for k, v in state.items()}, strict=False
    )
    # Tied weights (a head sharing the embeddings) may be absent from a state dict; any
    # other gap would merge random weights.
    tied = set(getattr(fresh.get_base_model(), "all_tied_weights_keys", {}) or {})
    real_missing = [k for k in missing if not any(k.endswith(t) for t in tied)]
    if real_missing or unexpected:
        raise RuntimeError(
            f"merging the adapters: the trained state does not fit the model "
            f"(missing {real_missing[:5]}, unexpected {unexpected[:5]})"
        )
    merged = fresh.merge_and_unload()
    return merged.to(dtype)
