"""Tensor-parallel groups stay on one node: the rule the service applies to the cluster's
node shapes, and the check every worker applies to where Ray placed it."""

from __future__ import annotations

import pytest

from contract.placement import (
    MOST,
    placement_shortfalls,
    tensor_parallel_straddles,
    workers_that_fit,
)
from contract.run_request import ResourcesSpec
from worker.reporting.nodes import layout_message

GPU8 = {"CPU": 64.0, "GPU": 8.0}
GPU6 = {"CPU": 64.0, "GPU": 6.0}


def _gpu(workers: int) -> ResourcesSpec:
    return ResourcesSpec(num_workers=workers, use_gpu=True, cpus_per_worker=1)


class TestShapes:
    def test_groups_that_fit_whole_on_nodes_are_placeable(self) -> None:
        assert placement_shortfalls(_gpu(16), [GPU8, GPU8], tensor_parallel_size=8) == []
        assert placement_shortfalls(_gpu(12), [GPU6, GPU6], tensor_parallel_size=2) == []

    def test_groups_that_would_straddle_are_refused_naming_the_field(self) -> None:
        # 12 GPUs in all, but a node of 6 holds one group of 4: two groups, three needed.
        (shortfall,) = placement_shortfalls(_gpu(12), [GPU6, GPU6], tensor_parallel_size=4)
        assert shortfall.field == "deepspeed.tensor_parallel_size"
        assert "tensor-parallel groups of 4, each on one node" in shortfall.message
        assert "hold 2 such groups (3 needed; the nodes fit 6, 6 workers each)" in (
            shortfall.message
        )

    def test_one_worker_per_node_cannot_hold_a_group_of_two(self) -> None:
        cpu1 = {"CPU": 1.0}
        res = ResourcesSpec(num_workers=2, cpus_per_worker=1)
        assert placement_shortfalls(res, [cpu1, cpu1]) == []  # data parallel: fine
        (shortfall,) = placement_shortfalls(res, [cpu1, cpu1], tensor_parallel_size=2)
        assert shortfall.field == "deepspeed.tensor_parallel_size"


class TestWhereRayPlacedThem:
    def test_groups_within_nodes(self) -> None:
        assert tensor_parallel_straddles(["a", "a", "b", "b"], 2) == []
        assert tensor_parallel_straddles(["a", "b", "c"], 1) == []

    @pytest.mark.parametrize(
        ("nodes", "tp", "straddling"),
        [
            (["a", "a", "a", "b"], 2, [(2, 3)]),
            (["a", "b", "b", "b"], 2, [(0, 1)]),
            (["a", "a", "a", "b", "b", "b", "b", "b"], 4, [(0, 1, 2, 3)]),
        ],
    )
    def test_groups_across_nodes(
        self, nodes: list[str], tp: int, straddling: list[tuple[int, ...]]
    ) -> None:
        assert tensor_parallel_straddles(nodes, tp) == straddling

    def test_the_layout_in_words(self) -> None:
        assert layout_message(["a" * 20, "a" * 20, "b" * 20]) == (
            "3 workers on 2 nodes (node aaaaaaaaaaaa: ranks 0, 1; node bbbbbbbbbbbb: rank 2)"
        )


@pytest.mark.parametrize("need", [5e-324, 1e-300, 0.0])
def test_any_demand_the_arithmetic_meets_gives_a_whole_count(need: float) -> None:
    # A quotient that overflows to infinity must not reach int(): that was a 500.
    assert workers_that_fit({"CPU": need}, {"CPU": 64.0}) == MOST
    assert workers_that_fit({"CPU": 1.0, "GPU": need}, {"CPU": 3.0, "GPU": 1.0}) == 3
