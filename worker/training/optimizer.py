"""The optimizer and learning-rate schedule of a run: AdamW (DeepSpeed's CPU Adam when the
optimizer is offloaded) over parameter groups that keep biases and norms out of weight decay."""

from __future__ import annotations

from typing import Any

from contract.run_request import RunSpec


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
        # On a GPU, torch's fused AdamW: one kernel over each of ZeRO's flat fp32 partitions
        # (a 16-bit run's master weights live there, on the device), where the default
        # (foreach) makes several passes over memory a step. Its device check runs at the
        # first step, when DeepSpeed has moved the partitions to the GPU; on CPU the default
        # stays (the suite's parity with Trainer and TRL is measured against it).
        optimizer = torch.optim.AdamW(
            groups, lr=tr.learning_rate, fused=True if spec.resources.use_gpu else None
        )
    scheduler = get_scheduler(
        tr.lr_scheduler, optimizer, num_warmup_steps=tr.warmup_steps, num_training_steps=total_steps
    )
    return optimizer, scheduler
