"""A gloo process group beside the training one, for the worker's own small reductions
(per-step metrics, evaluation sums).

Two reasons it is its own group. Under nccl (GPU runs) the default group cannot reduce
the CPU tensors these sums live in. And on any backend, a collective on the default group
queues behind DeepSpeed's gradient reductions and adds one more point per step where
every rank waits for the slowest; in a group of its own, a metric reduction runs in the
background beside the training (measured in bench/step_overhead.py).
"""

from __future__ import annotations

from typing import Any


def host_group() -> Any | None:
    """A new gloo group over every rank, or None outside distributed training.

    A collective: every rank must call it at the same point of its program.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")
