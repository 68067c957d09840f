"""Validation refuses a run the cluster can never place, naming what was asked and what the
cluster has; the cluster's view is cached, and a cluster that autoscales or cannot be read
refuses nothing.

The API tests run without Ray (`start_background=False`); the cluster's nodes are injected
as the app's ClusterView. tests/e2e/test_placement.py checks the same against a real head.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import RayUnavailable
from app.services.placement import ClusterView, placement_problems
from app.storage.models import Run
from contract.run_request import ResourcesSpec
from tests.factories import run_request

CPU_NODE = {"CPU": 2.0, "memory": 8e9, "node:__internal_head__": 1.0}


def _res(**fields: Any) -> ResourcesSpec:
    return ResourcesSpec.model_validate(fields)


def _only(problems: list[dict[str, str]]) -> dict[str, str]:
    assert len(problems) == 1, problems
    return problems[0]


class TestPlacementProblems:
    def test_a_gpu_run_on_a_cluster_without_gpus(self) -> None:
        problem = _only(placement_problems(_res(num_workers=2, use_gpu=True), [CPU_NODE]))
        assert problem["field"] == "resources.use_gpu"
        assert problem["message"].startswith(
            "the run asks for 2 workers x 1 GPU + 1 CPU, but the cluster has no GPUs"
        )

    def test_more_gpus_per_worker_than_any_node_has(self) -> None:
        nodes = [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 16.0, "GPU": 1.0}]
        res = _res(num_workers=2, use_gpu=True, gpus_per_worker=4)
        problem = _only(placement_problems(res, nodes))
        assert problem["field"] == "resources.gpus_per_worker"
        assert "4 GPUs fit on no node: the largest node has 2 GPUs" in problem["message"]

    def test_more_cpus_per_worker_than_any_node_has(self) -> None:
        # Two CPUs in total, but a worker must fit on one node.
        nodes = [{"CPU": 1.0}, {"CPU": 1.0}]
        problem = _only(placement_problems(_res(num_workers=4, cpus_per_worker=2), nodes))
        assert problem["field"] == "resources.cpus_per_worker"
        assert problem["message"].startswith(
            "the run asks for 4 workers x 2 CPUs, but 2 CPUs fit on no node: "
            "the largest node has 1 CPU"
        )

    def test_more_workers_than_the_nodes_hold(self) -> None:
        problem = _only(placement_problems(_res(num_workers=3), [CPU_NODE]))
        assert problem["field"] == "resources.num_workers"
        assert problem["message"].startswith(
            "the run asks for 3 workers x 1 CPU, but they fit 2 at most on the cluster's "
            "nodes (2 CPUs)"
        )

    def test_workers_are_counted_per_node_not_from_totals(self) -> None:
        # 3 CPUs in all, but each node holds one 1-CPU worker and half a CPU left over.
        nodes = [{"CPU": 1.5}, {"CPU": 1.5}]
        assert placement_problems(_res(num_workers=2), nodes) == []
        problem = _only(placement_problems(_res(num_workers=3), nodes))
        assert problem["field"] == "resources.num_workers"
        assert "they fit 2 at most on the cluster's nodes (3 CPUs)" in problem["message"]

    def test_a_worker_needing_what_no_single_node_combines(self) -> None:
        nodes = [{"CPU": 8.0, "GPU": 8.0}, {"CPU": 64.0}]
        res = _res(num_workers=1, use_gpu=True, cpus_per_worker=16)
        problem = _only(placement_problems(res, nodes))
        assert problem["field"] == "resources.cpus_per_worker"
        assert "no node has all of 1 GPU + 16 CPUs" in problem["message"]
        assert "0 GPUs + 64 CPUs; 8 GPUs + 8 CPUs" in problem["message"]

    @pytest.mark.parametrize(
        ("res", "nodes"),
        [
            (_res(num_workers=2), [CPU_NODE]),
            (_res(num_workers=4, cpus_per_worker=0.5), [CPU_NODE]),
            (_res(num_workers=1, cpus_per_worker=2), [{"CPU": 1.0}, {"CPU": 2.0}]),
            (_res(num_workers=4, use_gpu=True), [{"CPU": 4.0, "GPU": 2.0}] * 2),
            (_res(num_workers=2, use_gpu=True, gpus_per_worker=2), [{"CPU": 8.0, "GPU": 4.0}]),
        ],
        ids=["fits", "fractional-cpus", "one-big-node", "gpus-over-nodes", "two-gpus-each"],
    )
    def test_runs_the_nodes_can_hold_are_accepted(
        self, res: ResourcesSpec, nodes: list[dict[str, float]]
    ) -> None:
        assert placement_problems(res, nodes) == []


class FakeNodes:
    """The cluster's node reader, counted: what RayJobs.node_resources answers."""

    def __init__(self, nodes: list[dict[str, float]] | Exception) -> None:
        self.answer = nodes
        self.reads = 0
        self.gate = threading.Event()  # a read answers once the gate is open
        self.gate.set()

    def __call__(self) -> list[dict[str, float]]:
        self.gate.wait(5)
        self.reads += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _settled(view: ClusterView) -> None:
    """Wait for a background read the last call started."""
    reading = view.refresh()
    if reading is not None:
        reading.join(5)


class TestClusterView:
    def test_reads_once_within_the_ttl_then_refreshes_in_the_background(self) -> None:
        reader, clock = FakeNodes([CPU_NODE]), Clock()
        view = ClusterView(reader, autoscales=False, ttl_s=5, clock=clock)
        assert view.nodes() == [CPU_NODE]  # the first request waits for the first read
        clock.now += 4
        assert view.nodes() == [CPU_NODE]
        assert reader.reads == 1

        reader.answer = [CPU_NODE, CPU_NODE]
        reader.gate.clear()
        clock.now += 2
        assert view.nodes() == [CPU_NODE]  # stale: answered at once, read again behind it
        reader.gate.set()
        _settled(view)
        assert view.nodes() == [CPU_NODE, CPU_NODE]
        assert reader.reads == 2

    def test_an_autoscaling_cluster_is_not_judged_by_its_nodes(self) -> None:
        reader = FakeNodes([CPU_NODE])
        view = ClusterView(reader, autoscales=True)
        assert view.problems(_res(use_gpu=True)) == []
        assert reader.reads == 0

    @pytest.mark.parametrize(
        "answer",
        [RayUnavailable("cannot reach Ray"), RuntimeError("surprise"), []],
        ids=["unreachable", "unexpected-error", "no-node-yet"],
    )
    def test_a_cluster_that_cannot_be_read_refuses_nothing(self, answer: Any) -> None:
        view = ClusterView(FakeNodes(answer), autoscales=False, first_read_wait_s=0.3)
        assert view.nodes() is None  # after the first seconds' wait, not for good
        assert view.problems(_res(use_gpu=True)) == []

    def test_the_first_requests_wait_briefly_for_a_cluster_still_starting(self) -> None:
        """Issue 39: a GPU run posted in the service's first seconds, while the head had no
        node registered yet, was judged by nothing and accepted on a CPU-only cluster. The
        first requests wait (a few seconds at most) for the nodes, read again meanwhile."""
        answers = iter([[], RayUnavailable("the dashboard is starting"), []])

        def starting_head() -> list[dict[str, float]]:
            answer = next(answers, [CPU_NODE])
            if isinstance(answer, Exception):
                raise answer
            return answer

        view = ClusterView(starting_head, autoscales=False)
        problems = view.problems(_res(use_gpu=True))
        assert [p["field"] for p in problems] == ["resources.use_gpu"]

        # A cluster that never tells keeps a request no longer than the wait.
        never = FakeNodes([])
        began = time.monotonic()
        view = ClusterView(never, autoscales=False, first_read_wait_s=0.6)
        assert view.problems(_res(use_gpu=True)) == []
        assert time.monotonic() - began < 3
        assert never.reads >= 2


def _problems(response: Any) -> dict[str, str]:
    return {p["field"]: p["message"] for p in response.json()["detail"]}


def _count_runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def _with_cluster(client: TestClient, reader: FakeNodes, *, autoscales: bool = False) -> None:
    """The view of a service past its first seconds (no request waits for the nodes)."""
    view = ClusterView(reader, autoscales=autoscales, first_read_wait_s=0)
    client.app.state.tuneyard.cluster = view  # type: ignore[attr-defined]
    _settled(view)


class TestPlacementAtValidation:
    def test_validate_and_create_refuse_a_gpu_run_on_a_cpu_cluster_alike(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        _with_cluster(client, FakeNodes([CPU_NODE]))
        body = run_request(tmp_path, resources={"num_workers": 2, "use_gpu": True})

        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is False
        (error,) = report["errors"]
        assert error["field"] == "resources.use_gpu"
        assert "2 workers x 1 GPU + 1 CPU, but the cluster has no GPUs" in error["message"]

        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert response.json()["detail"] == report["errors"]
        assert _count_runs(session_factory) == 0

    def test_placement_is_reported_with_the_other_problems(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        _with_cluster(client, FakeNodes([CPU_NODE]))
        body = run_request(tmp_path, model=str(tmp_path / "nope"), resources={"num_workers": 3})
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        problems = _problems(response)
        assert "does not exist" in problems["model"]
        assert "fit 2 at most on the cluster's nodes (2 CPUs)" in problems["resources.num_workers"]

    @pytest.mark.parametrize("case", ["autoscales", "unreachable"])
    def test_accepted_when_the_cluster_may_grow_or_cannot_be_read(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, case: str
    ) -> None:
        if case == "autoscales":
            _with_cluster(client, FakeNodes([CPU_NODE]), autoscales=True)
        else:
            _with_cluster(client, FakeNodes(RayUnavailable("cannot reach Ray")))
        body = run_request(tmp_path, resources={"num_workers": 2, "use_gpu": True})
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is True, report["errors"]
        assert client.post("/v1/runs", json=body, headers=auth).status_code == 201
