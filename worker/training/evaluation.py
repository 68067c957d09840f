"""Evaluation on the eval split: loss and perplexity, or accuracy and F1 for classification.

Every rank evaluates its shard; sums are all-reduced, so the numbers are over the whole
split: the loss is the mean over every target of the split (tokens, or examples for
classification), as a training step's is (worker/training/step_loss.py). With method dpo: the DPO
loss, the mean over the split's pairs, and TRL's pair metrics (`eval_rewards/...`,
`eval_logps/...`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from worker.data.loading import IGNORE_INDEX, model_inputs, packs_in_one_row_for
from worker.training.step_loss import targets_in


def evaluate(
    engine: Any,
    loader: Any,
    *,
    task: str,
    num_labels: int,
    group: Any = None,
    method: Any = None,
    reference: Any = None,
) -> dict[str, float]:
    """`group`: the process group to sum over (worker.reporting.host_group's); None is the default.
    `method`: the run's (spec.method); for dpo, `reference` is worker.training.dpo's."""
    import torch
    import torch.distributed as dist

    device = next(engine.module.parameters()).device
    if method is not None and method.type == "dpo":
        return _evaluate_dpo(
            engine, loader, device=device, group=group, beta=method.beta, reference=reference
        )
    one_row = packs_in_one_row_for(engine.module)
    engine.eval()
    # loss sum, its weight, correct, count; then per class: true pos., false pos., false neg.
    # Summed on the device and copied to the host once: no sync per batch on a GPU.
    totals = torch.zeros(4 + 3 * num_labels, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch, real in zip(loader, real_rows(loader), strict=False):
            if real < batch["labels"].shape[0]:
                # Rows the sampler repeated so that every rank runs as many forwards.
                batch = {**batch, "labels": batch["labels"].clone()}
                batch["labels"][real:] = IGNORE_INDEX
            # The same targets a training step counts, on the CPU batch; a batch without
            # any has a NaN mean loss and adds nothing.
            targets = targets_in(batch, task=task)
            if not targets:
                # Still run the forward: under ZeRO-3 and AutoTP it is collective.
                engine(**model_inputs(_on(device, batch), one_row=one_row))
                continue
            batch = _on(device, batch)
            out = engine(**model_inputs(batch, one_row=one_row))
            totals[0] += out.loss.detach().double() * targets
            totals[1] += targets
            if task == "sequence_classification":
                _count_classes(totals, out.logits, batch["labels"], num_labels=num_labels)
    engine.train()
    totals = totals.cpu()
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


def _evaluate_dpo(
    engine: Any, loader: Any, *, device: Any, group: Any, beta: float, reference: Any
) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from contract.eval_metrics import PAIR_METRICS
    from worker.training.dpo import dpo_forward

    engine.eval()
    # loss sum, pairs, then the pair metrics' sums; on the device, copied to the host once.
    totals = torch.zeros(2 + len(PAIR_METRICS), dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch, real in zip(loader, real_rows(loader), strict=False):
            rows = batch["labels"].shape[0] // 2  # pairs in the batch, repeats included
            if real < rows:
                # Pairs the sampler repeated: both rows out (chosen rows first, then rejected).
                batch = {**batch, "labels": batch["labels"].clone()}
                batch["labels"][real:rows] = IGNORE_INDEX
                batch["labels"][rows + real :] = IGNORE_INDEX
            pairs = targets_in(batch, task="causal_lm", method="dpo")
            # Every rank runs both forwards, repeats included: under ZeRO-3 they are collective.
            out = dpo_forward(
                engine,
                {k: v.to(device, non_blocking=True) for k, v in batch.items()},
                reference=reference,
                beta=beta,
            )
            totals[0] += out.mean_loss.double() * pairs
            totals[1] += pairs
            totals[2:] += out.sums
    engine.train()
    totals = totals.cpu()
    if dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    counted = max(float(totals[1]), 1.0)
    metrics = {"eval_loss": float(totals[0]) / counted}
    for name, value in zip(PAIR_METRICS, totals[2:], strict=True):
        metrics[f"eval_{name}"] = float(value) / counted
    return metrics


def _count_classes(totals: Any, logits: Any, labels: Any, *, num_labels: int) -> None:
    """Adds correct and counted examples, and per class the true positives, false
    positives and false negatives, to `totals` (laid out as in `evaluate`). One-hot sums
    rather than boolean indexing or bincount, which wait for the GPU to size their output."""
    import torch.nn.functional as F

    valid = (labels != IGNORE_INDEX).unsqueeze(-1)
    truth = F.one_hot(labels.clamp(min=0), num_labels) * valid
    said = F.one_hot(logits.argmax(dim=-1), num_labels) * valid
    tp = (truth * said).sum(dim=0)
    totals[2] += tp.sum()
    totals[3] += valid.sum()
    for i, counts in enumerate(
        (tp, (said * (1 - truth)).sum(dim=0), (truth * (1 - said)).sum(dim=0))
    ):
        totals[4 + i * num_labels : 4 + (i + 1) * num_labels] += counts


def real_rows(loader: Any) -> Iterator[int]:
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


def _on(device: Any, batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
