"""The DeepSpeed config a run trains with. One function, used by the worker and the service."""

from __future__ import annotations

from typing import Any

from contract.run_request import RunDefinition

# DeepSpeed prints its own progress every N steps; tuneyard reports metrics itself.
_QUIET_STEPS = 10**9


def resolve_precision(spec: RunDefinition, *, bf16_supported: bool) -> str:
    """`auto` → bf16 where the GPU supports it, else fp16 on GPU; fp32 on CPU.

    fp32 on CPU because bf16 matmuls are slow on CPUs without AMX and the runs there
    are small; users can still ask for bf16 explicitly. `bf16_supported` must be native
    support (`torch.cuda.is_bf16_supported(including_emulation=False)`): V100 and T4
    emulate bf16 far slower than they run fp16.
    """
    requested = spec.deepspeed.precision
    if requested != "auto":
        return requested
    if not spec.resources.use_gpu:
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


def bucket_sizes(stage: int, hidden_size: int | None) -> dict[str, int]:
    """ZeRO's communication buckets sized from the model, as Hugging Face's "auto" values are.

    DeepSpeed's defaults (5e8 elements for the reduce and all-gather buckets, 5e7 prefetch)
    suit nothing in particular: with overlap_comm the stage-2 buckets alone take about
    4.5 x 5e8 x 4 bytes = 9 GB per GPU. hidden² elements keep a bucket to about one
    layer's matrices (64 MB at hidden 4096); parameters under 10 x hidden elements (norms,
    biases) stay whole on every rank in stage 3 instead of being gathered one by one.
    """
    if not hidden_size or stage == 0:
        return {}
    square = hidden_size * hidden_size
    sizes = {"reduce_bucket_size": square}
    if stage in (1, 2):
        sizes["allgather_bucket_size"] = square
    if stage == 3:
        sizes["stage3_prefetch_bucket_size"] = int(0.9 * square)
        sizes["stage3_param_persistence_threshold"] = 10 * hidden_size
    return sizes


def resolve_deepspeed_config(
    spec: RunDefinition, *, bf16_supported: bool = True, hidden_size: int | None = None
) -> dict[str, Any]:
    """`hidden_size`: the model config's; unknown (a hub id the service cannot read)
    leaves DeepSpeed's default bucket sizes."""
    ds, tr = spec.deepspeed, spec.training
    precision = resolve_precision(spec, bf16_supported=bf16_supported)

    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1 and ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": spec.resources.use_gpu}
    if ds.zero_stage == 3:
        # Needed for a full HF export at the end (save_16bit_model gathers the shards).
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if ds.offload_params == "cpu":
            zero["offload_param"] = {"device": "cpu", "pin_memory": spec.resources.use_gpu}
    if ds.zero_stage in (2, 3):
        zero["overlap_comm"] = spec.resources.use_gpu
    zero.update(bucket_sizes(ds.zero_stage, hidden_size))

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": tr.batch_size_per_worker,
        "gradient_accumulation_steps": tr.gradient_accumulation_steps,
        "gradient_clipping": tr.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
    }
    if ds.tensor_parallel_size > 1:
        # AutoTP: DeepSpeed shards the linear layers and builds the TP x DP process groups.
        # It checks train_batch_size against the whole world before it knows the TP size,
        # so the global batch is left for it to derive.
        config["tensor_parallel"] = {"autotp_size": ds.tensor_parallel_size}
    else:
        config["train_batch_size"] = global_batch_size(spec)
    return config


def global_batch_size(spec: RunDefinition) -> int:
    tr = spec.training
    return tr.batch_size_per_worker * tr.gradient_accumulation_steps * spec.data_parallel_size


def hidden_size_of(config: dict[str, Any]) -> int | None:
    """The width the bucket sizes scale with, from a model's config.json as a dict."""
    for key in ("hidden_size", "n_embd", "d_model", "dim"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    text = config.get("text_config")
    return hidden_size_of(text) if isinstance(text, dict) else None


def torch_dtype_name(precision: str) -> str:
    """The dtype a run's weights are loaded, trained and exported in."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
