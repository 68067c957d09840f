"""What `POST /v1/runs/validate` tells before a run: the resolved config and its cost.

Model-state memory follows the ZeRO paper (Rajbhandari et al., 2020, section 3): with Ψ
parameters per tensor-parallel shard and Adam, mixed precision keeps 2Ψ bytes of
parameters, 2Ψ of gradients and 12Ψ of optimizer state (fp32 master weights, momentum,
variance); fp32 training keeps 4Ψ + 4Ψ + 8Ψ. Stage 1 partitions the optimizer state over
the data-parallel ranks, stage 2 the gradients too, stage 3 the parameters too.
Activations and buffers come on top and depend on the batch; they are not included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.services.model_files import checkpoint_parameters
from app.services.run_rules import CheckedRequest
from contract.run_request import RunDefinition
from worker.deepspeed_config import global_batch_size, resolve_deepspeed_config, resolve_precision

# A GPU run with precision=auto resolves on the cluster; validation assumes a bf16 GPU.
ASSUME_BF16_GPU = True


def resolve(checked: CheckedRequest) -> dict[str, Any]:
    spec, plan = checked.resolved, checked.plan
    return {
        "deepspeed_config": resolve_deepspeed_config(spec, bf16_supported=ASSUME_BF16_GPU),
        "precision": resolve_precision(spec, bf16_supported=ASSUME_BF16_GPU),
        "data_parallel_size": spec.data_parallel_size,
        "tensor_parallel_size": spec.deepspeed.tensor_parallel_size,
        "global_batch_size": global_batch_size(spec),
        "steps_per_epoch": plan.steps_per_epoch if plan else None,
        "total_steps": plan.total_steps if plan else spec.training.max_steps,
    }


def estimate(checked: CheckedRequest) -> dict[str, Any]:
    spec = checked.resolved
    parameters = (
        checkpoint_parameters(Path(spec.model)) if checked.model_config is not None else None
    )
    return {
        "parameters": parameters,
        "model_states_bytes_per_worker": (
            model_states_bytes(spec, parameters) if parameters is not None else None
        ),
        "tokens_per_step": global_batch_size(spec) * spec.training.seq_length,
        "method": "ZeRO paper formulas for model states (parameters, gradients, Adam state) "
        "of the parameters in the model's safetensors files; activations not included",
    }


def model_states_bytes(spec: RunDefinition, parameters: int) -> dict[str, int]:
    ds = spec.deepspeed
    precision = resolve_precision(spec, bf16_supported=ASSUME_BF16_GPU)
    psi = parameters / ds.tensor_parallel_size
    dp = spec.data_parallel_size
    if precision == "fp32":
        params, grads, optim = 4 * psi, 4 * psi, 8 * psi
    else:
        params, grads, optim = 2 * psi, 2 * psi, 12 * psi
    stage = ds.zero_stage
    if stage >= 1:
        optim /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    offloaded = 0.0
    if ds.offload_optimizer == "cpu":
        offloaded += optim
    if ds.offload_params == "cpu":
        offloaded += params
    total = params + grads + optim
    return {
        "parameters": int(params),
        "gradients": int(grads),
        "optimizer_states": int(optim),
        "total": int(total),
        "on_device": int(total - offloaded),
        "offloaded_to_cpu": int(offloaded),
    }
