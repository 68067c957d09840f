"""Evaluation on the eval split: loss and perplexity, or accuracy and F1 for classification.

Every rank evaluates its shard; sums are all-reduced, so the numbers are over the whole
split.
"""

from __future__ import annotations

import math
from typing import Any

from worker.data import IGNORE_INDEX


def evaluate(
    engine: Any, loader: Any, *, task: str, num_labels: int, group: Any = None
) -> dict[str, float]:
    """`group`: the process group to sum over (worker.host_group's); None is the default."""
    import torch
    import torch.distributed as dist

    device = next(engine.module.parameters()).device
    engine.eval()
    # loss sum, its weight, correct, count; then per class: true pos., false pos., false neg.
    totals = torch.zeros(4 + 3 * num_labels, dtype=torch.float64)
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = engine(**batch)
            labels = batch["labels"]
            if task == "sequence_classification":
                predicted = out.logits.argmax(dim=-1)
                totals[0] += float(out.loss) * labels.numel()
                totals[1] += labels.numel()
                totals[2] += float((predicted == labels).sum())
                totals[3] += labels.numel()
                for c in range(num_labels):
                    totals[4 + c] += float(((predicted == c) & (labels == c)).sum())
                    totals[4 + num_labels + c] += float(((predicted == c) & (labels != c)).sum())
                    totals[4 + 2 * num_labels + c] += float(
                        ((predicted != c) & (labels == c)).sum()
                    )
            else:
                # HF shifts labels by one inside the model; weigh each batch by its targets.
                targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
                if targets:  # a batch without targets has a NaN mean loss: skip it
                    totals[0] += float(out.loss) * targets
                    totals[1] += targets
    engine.train()
    if dist.is_initialized():
        # Under AutoTP each batch is counted once per TP rank; every metric below is a
        # ratio of these sums, so the repetition cancels out.
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    loss = float(totals[0]) / max(float(totals[1]), 1.0)
    if task != "sequence_classification":
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
    metrics = {"eval_loss": loss, "eval_accuracy": float(totals[2]) / max(float(totals[3]), 1.0)}
    tp, fp, fn = (totals[4 + i * num_labels : 4 + (i + 1) * num_labels] for i in range(3))
    f1 = [_f1(float(t), float(p), float(n)) for t, p, n in zip(tp, fp, fn, strict=True)]
    # Binary tasks (MRPC and the like) report F1 of the positive class, as GLUE does.
    metrics["eval_f1"] = f1[1] if num_labels == 2 else sum(f1) / num_labels
    return metrics


def _f1(tp: float, fp: float, fn: float) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
