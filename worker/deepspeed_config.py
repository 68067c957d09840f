"""The DeepSpeed config a run trains with. One function, used by the worker and the service."""

from __future__ import annotations

from typing import Any

from contract.run_request import RunDefinition

# DeepSpeed prints its own progress every N steps; tuneyard reports metrics itself.
_QUIET_STEPS = 10**9


def resolve_precision(spec: RunDefinition, *, bf16_supported: bool) -> str:
    """`auto` → bf16 where the GPU supports it, else fp16 on GPU; fp32 on CPU.

    fp32 on CPU because bf16 matmuls are slow on CPUs without AMX and the runs there
    are small; users can still ask for bf16 explicitly.
    """
    requested = spec.deepspeed.precision
    if requested != "auto":
        return requested
    if not spec.resources.use_gpu:
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


def resolve_deepspeed_config(spec: RunDefinition, *, bf16_supported: bool = True) -> dict[str, Any]:
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
