"""The job driver's placement check before `fit()`, and how a placement failure reads.

The driver reads the nodes from Ray (`ray.nodes()`, `ray.available_resources()`); the
decision is the pure `placement_decision`, tested here on the nodes Ray would report.
tests/e2e/test_placement.py runs the whole path on the real local cluster.
"""

from __future__ import annotations

import pytest
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from ray.train.v2.api.exceptions import ControllerError

from contract.job_env import PLACEMENT_TIMEOUT_ENV
from contract.run_request import ResourcesSpec
from worker.reporting.failures import describe_failure, failure_code
from worker.reporting.placement import Unplaceable, placement_decision

CPU_NODE = {"CPU": 2.0, "memory": 8e9}
GPU_RUN = ResourcesSpec(num_workers=2, use_gpu=True)


class TestPlacementDecision:
    def test_a_run_the_nodes_can_never_hold_fails_at_once(self) -> None:
        with pytest.raises(Unplaceable) as raised:
            placement_decision(GPU_RUN, [CPU_NODE], CPU_NODE, autoscales=False, timeout_s=20)
        assert str(raised.value) == (
            "the run asks for 2 workers x 1 GPU + 1 CPU, but the cluster has no GPUs; "
            "the cluster does not autoscale"
        )

    def test_on_a_cluster_that_may_grow_it_waits_saying_for_what(self) -> None:
        message = placement_decision(GPU_RUN, [CPU_NODE], CPU_NODE, autoscales=True, timeout_s=20)
        assert message == (
            "the run asks for 2 workers x 1 GPU + 1 CPU, but the cluster has no GPUs; the "
            "cluster may grow (autoscaling): waiting up to 20 s for the workers to be placed"
        )

    def test_busy_resources_make_it_wait_naming_what_is_free(self) -> None:
        res = ResourcesSpec(num_workers=2)
        message = placement_decision(res, [CPU_NODE], {"CPU": 1.0}, autoscales=False, timeout_s=600)
        assert message == (
            "the run needs 2 CPUs for 2 workers, the cluster has 1 CPU free now (other runs "
            "hold the rest): waiting up to 600 s for the workers to be placed"
        )

    def test_free_resources_need_no_wait(self) -> None:
        res = ResourcesSpec(num_workers=2)
        assert placement_decision(res, [CPU_NODE], CPU_NODE, autoscales=False) is None


class TestPlacementFailures:
    def test_the_drivers_own_refusal_is_unplaceable(self) -> None:
        exc = Unplaceable("the run asks for 2 workers x 1 GPU + 1 CPU, but ...")
        assert failure_code(exc) == "unplaceable"
        assert describe_failure(exc) == str(exc)

    def test_ray_trains_start_timeout_is_unplaceable_and_names_the_timeout(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(PLACEMENT_TIMEOUT_ENV, "20.0")
        exc = ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))
        # Not `cluster_error`, which the service answers with a new attempt.
        assert failure_code(exc) == "unplaceable"
        assert describe_failure(exc) == (
            "the run's 2 workers could not be placed within the placement timeout (20 s, "
            "TUNEYARD_PLACEMENT_TIMEOUT_S): the cluster did not have or add the resources "
            "they ask for; see the run's waiting_for_resources event"
        )

    def test_other_controller_errors_keep_their_own_words(self) -> None:
        exc = ControllerError(ValueError("bad config"))
        assert failure_code(exc) == "training_error"
        assert "bad config" in describe_failure(exc)
