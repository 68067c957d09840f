"""A step is the mean over its targets.

Every optimizer step's loss, and so its gradient, is the sum of its per-target losses
divided by the number of targets in the whole step: across its gradient-accumulation
micro-batches and its data-parallel ranks, with the ranks of a tensor-parallel group (which
see the same batch) counted once. A target is a next-token label for a causal LM (Hugging
Face models shift the labels inside the model, so `labels[:, 1:] != -100`) and an example
for classification. For DPO a target is a preference pair (worker/training/dpo.py: its micro-batch
loss is the mean of its pairs' losses). This is what Hugging Face's Trainer computes since
transformers 4.46, so that changing `num_workers` or `gradient_accumulation_steps` changes
speed and memory, not the mathematics: a short row no longer weighs as much as a long one.

DeepSpeed, left alone, averages instead: `engine.backward` divides each micro-batch's loss
by gradient_accumulation_steps, and every ZeRO stage averages gradients over the
data-parallel group (DeepSpeed 0.19.8: engine.py `backward`, `allreduce_bucket`;
stage_1_and_2.py `average_tensor`; stage3.py), with AutoTP over world / tp ranks. So each
micro-batch backs up (sum of its target losses) / N * dp with `scale_wrt_gas=False`: the
dp-average then leaves exactly grad(sum of the step's target losses) / N, and gradient
clipping, which runs after the average, sees that gradient.

The step's N is counted on the CPU batches before they move to the device and summed over
ranks in one small all-reduce on the host (gloo) group per optimizer step, so a GPU run
pays no extra synchronisation per micro-batch.
"""

from __future__ import annotations

from typing import Any

from worker.data.loading import IGNORE_INDEX


def targets_in(batch: dict[str, Any], *, task: str, method: str = "sft") -> int:
    """The targets of one micro-batch (evaluation marks rows to leave out as ignored);
    `method` "dpo": its pairs (worker/data/preference.py's batches: chosen rows, then rejected)."""
    labels = batch["labels"]
    if method == "dpo":
        from worker.training.dpo import valid_pairs

        return int(valid_pairs(labels).sum())
    if task == "sequence_classification":
        return int((labels != IGNORE_INDEX).sum())
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def step_targets(local: int, *, group: Any, tensor_parallel_size: int) -> int:
    """The targets of the whole step, over every rank; tensor-parallel peers count once."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return local
    total = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total) // tensor_parallel_size


def step_share(mean_loss: Any, *, targets: int, step_targets: int) -> Any:
    """This micro-batch's part of the step's loss: the sum of its target losses over the
    step's targets. Models return the mean over the micro-batch's own targets."""
    if targets == 0:
        # The mean of nothing is NaN; a zero that keeps the graph still runs the backward
        # every rank must join under ZeRO-3.
        return mean_loss.nan_to_num(0.0) * 0.0
    return mean_loss * (targets / max(step_targets, 1))


def backward(engine: Any, share: Any, *, data_parallel_size: int) -> None:
    """Back up a micro-batch's share so that DeepSpeed's dp-average leaves the step's mean."""
    engine.backward(share * data_parallel_size, scale_wrt_gas=False)
