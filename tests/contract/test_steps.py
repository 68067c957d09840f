"""contract/steps.py: the step count the service estimates is the one the worker trains."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from contract.run_request import RunRequest
from contract.steps import StepPlan, examples_used, micro_batches_per_rank


def _request(**training: Any) -> RunRequest:
    return RunRequest.model_validate(
        {
            "model": "/m",
            "dataset": {"source": "/d"},
            "training": training,
            "resources": {"num_workers": 1},
        }
    )


@pytest.mark.parametrize("examples", [7, 40, 41, 95])
@pytest.mark.parametrize(("dp", "batch"), [(1, 4), (2, 3), (3, 2)])
def test_micro_batches_match_the_workers_loader(examples: int, dp: int, batch: int) -> None:
    """The worker's own loader (a DistributedSampler and a DataLoader, both drop_last)."""
    for rank in range(dp):
        sampler: DistributedSampler[int] = DistributedSampler(
            list(range(examples)), num_replicas=dp, rank=rank, shuffle=True, drop_last=True
        )
        loader = DataLoader(
            list(range(examples)), batch_size=batch, sampler=sampler, drop_last=True
        )
        assert len(loader) == micro_batches_per_rank(
            examples, data_parallel_size=dp, batch_size=batch
        )


def test_max_samples_caps_the_examples() -> None:
    assert examples_used(100, None) == 100
    assert examples_used(100, 30) == 30
    assert examples_used(10, 30) == 10


def test_epochs_count_only_whole_steps() -> None:
    plan = StepPlan.for_examples(
        _request(epochs=3, batch_size_per_worker=2, gradient_accumulation_steps=2), examples=21
    )
    assert (plan.steps_per_epoch, plan.total_steps) == (5, 15)  # 10 micro-batches, 2 per step
    assert plan.position(7) == (1, 4)
    assert plan.epoch_at(15) == 3.0


def test_max_steps_wins_over_epochs() -> None:
    plan = StepPlan.for_examples(_request(epochs=3, max_steps=4), examples=100)
    assert plan.total_steps == 4


def test_too_little_data_for_one_step_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="fewer than gradient_accumulation_steps"):
        StepPlan.for_examples(_request(gradient_accumulation_steps=8), examples=5)
