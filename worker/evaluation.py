"""Evaluation on the eval split: loss and perplexity, or accuracy and F1 for classification.

Every rank evaluates its shard; sums are all-reduced, so the numbers are over the whole
split: the loss is the mean over every target of the split (tokens, or examples for
classification), as a training step's is (worker/step_loss.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from worker.data import IGNORE_INDEX
from worker.step_loss import targets_in


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
        for batch, real in zip(loader, _real_rows(loader), strict=False):
            if real < batch["labels"].shape[0]:
                # Rows the sampler repeated so that every rank runs as many forwards.
                batch = {**batch, "labels": batch["labels"].clone()}
                batch["labels"][real:] = IGNORE_INDEX
            batch = {k: v.to(device) for k, v in batch.items()}
            out = engine(**batch)
            labels = batch["labels"]
            # The same targets a training step counts; a batch without any has a NaN
            # mean loss and adds nothing.
            targets = targets_in(batch, task=task)
            if not targets:
                continue
            totals[0] += float(out.loss) * targets
            totals[1] += targets
            if task == "sequence_classification":
                valid = labels != IGNORE_INDEX
                predicted = out.logits.argmax(dim=-1)
                totals[2] += float(((predicted == labels) & valid).sum())
                totals[3] += targets
                for c in range(num_labels):
                    hit, said = valid & (labels == c), valid & (predicted == c)
                    totals[4 + c] += float((said & hit).sum())
                    totals[4 + num_labels + c] += float((said & ~hit).sum())
                    totals[4 + 2 * num_labels + c] += float((hit & ~said).sum())
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


def _real_rows(loader: Any) -> Iterator[int]:
    """How many leading rows of each batch are examples of their own.

    An unshuffled DistributedSampler pads the split with repeats of its first examples
    until every rank has as many; rank r's k-th row is the example at r + k * ranks, a
    repeat once that reaches the split's length. Anything else yields whole batches."""
    from torch.utils.data import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.shuffle:
        while True:
            yield 1 << 62
    size = len(sampler.dataset)  # type: ignore[arg-type]
    rank, ranks, batch_size = sampler.rank, sampler.num_replicas, loader.batch_size
    k = 0
    while True:
        yield sum(1 for j in range(batch_size) if rank + (k + j) * ranks < size)
        k += batch_size


def _f1(tp: float, fp: float, fn: float) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
