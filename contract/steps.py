"""How many optimizer steps a run takes, counted the same way by the service's estimate
(`POST /v1/runs/validate`) and by the worker that trains them."""

from __future__ import annotations

from contract.run_request import RunDefinition


def examples_used(available: int, max_samples: int | None) -> int:
    """The worker trains on the first `dataset.max_samples` examples, when set."""
    return available if max_samples is None else min(available, max_samples)


def micro_batches_per_rank(examples: int, *, data_parallel_size: int, batch_size: int) -> int:
    """As the worker's loader yields them: its DistributedSampler (drop_last) gives each
    data-parallel rank examples // dp of them, and the DataLoader (drop_last) whole batches."""
    return (examples // data_parallel_size) // batch_size


class StepPlan:
    """Maps optimizer steps to epochs and data positions, so a resume continues exactly."""

    def __init__(self, spec: RunDefinition, *, micro_batches_per_epoch: int) -> None:
        accum = spec.training.gradient_accumulation_steps
        self.accum = accum
        # Only whole optimizer steps per epoch, so epochs line up with steps on resume.
        self.steps_per_epoch = micro_batches_per_epoch // accum
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset gives {micro_batches_per_epoch} batches per worker per epoch, fewer "
                f"than gradient_accumulation_steps ({accum}): add data or lower "
                "batch_size_per_worker, gradient_accumulation_steps or num_workers"
            )
        epochs = spec.training.epochs or 1
        self.total_steps = spec.training.max_steps or epochs * self.steps_per_epoch

    @classmethod
    def for_examples(cls, spec: RunDefinition, *, examples: int) -> StepPlan:
        """The plan for `examples` training examples per epoch (after tokenizing and packing)."""
        return cls(
            spec,
            micro_batches_per_epoch=micro_batches_per_rank(
                examples,
                data_parallel_size=spec.data_parallel_size,
                batch_size=spec.training.batch_size_per_worker,
            ),
        )

    def epoch_at(self, step: int) -> float:
        return round(step / self.steps_per_epoch, 4)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, micro-batches of that epoch already trained) after `step` steps."""
        epoch, done_in_epoch = divmod(step, self.steps_per_epoch)
        return epoch, done_in_epoch * self.accum

    @property
    def micro_batches_per_epoch_used(self) -> int:
        return self.steps_per_epoch * self.accum
