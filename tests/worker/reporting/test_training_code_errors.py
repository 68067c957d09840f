"""worker/reporting/failures.py: a rank's own error ends the run, a dead worker is Ray's to
retry."""

from __future__ import annotations

import pickle

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.train.v2._internal.exceptions import (
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from worker.reporting.failures import (
    TrainingCodeError,
    describe_failure,
    failure_code,
    raised_by_training_code,
)
from worker.training.trainer import TrainingErrorStop


def task_error(inner: BaseException) -> RayTaskError:
    """How Ray hands back what a worker's train function raised."""
    return RayTaskError("train_fn", "Traceback ...", inner)


def test_what_the_code_raised_is_a_training_error_and_a_dead_actor_is_not() -> None:
    assert raised_by_training_code(IndexError("index out of range in self"))
    assert raised_by_training_code(task_error(RuntimeError("CUDA out of memory")))
    assert not raised_by_training_code(ActorDiedError())
    # A survivor's collective error when a peer died is the death's, not its own code's.
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    assert not raised_by_training_code(task_error(lost))


def test_the_callback_ends_the_run_with_the_lowest_failing_rank() -> None:
    errors: dict[int, Exception] = {
        3: RuntimeError("second"),
        1: IndexError("index out of range in self"),
    }
    with pytest.raises(TrainingCodeError) as caught:
        TrainingErrorStop().after_exception(None, errors)
    assert caught.value.rank == 1
    assert str(caught.value) == "worker rank 1: IndexError: index out of range in self"


@pytest.mark.parametrize(
    "dead",
    [
        ActorDiedError(),
        # How Ray Train V2 reports a worker process killed under it (seen with SIGKILL).
        WorkerHealthCheckFailedError("The actor is dead", failure=ActorDiedError()),
        WorkerHealthCheckTimeoutError("no answer"),
    ],
    ids=["actor-died", "health-check-failed", "health-check-timeout"],
)
def test_the_callback_leaves_dead_workers_to_rays_retries(dead: Exception) -> None:
    errors: dict[int, Exception] = {0: dead, 1: RuntimeError("Connection reset")}
    TrainingErrorStop().after_exception(None, errors)  # no raise: Ray restarts the group
    assert failure_code(WorkerGroupError("lost", {0: dead})) == "cluster_error"


def test_the_error_crosses_from_the_controller_to_the_driver_and_reads_well() -> None:
    # Ray pickles the controller's failure to the job's driver.
    error = pickle.loads(pickle.dumps(TrainingCodeError.of(0, ValueError("bad row 7"))))
    failed = ControllerError(error)

    assert describe_failure(failed) == "worker rank 0: ValueError: bad row 7"
    assert failure_code(failed) == "training_error"


def test_a_worker_group_error_from_a_dead_node_is_a_cluster_error() -> None:
    failed = WorkerGroupError("lost", {0: ActorDiedError()})
    assert failure_code(failed) == "cluster_error"
