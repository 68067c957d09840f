"""Builds the Ray Train `TorchTrainer` for a run, and reports its checkpoints to the service."""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from contract.run_request import RunSpec
from contract.storage import Storage


def build_trainer(spec: RunSpec, *, fit_started_at: float | None = None) -> Any:
    """The run's trainer. `fit_started_at` (seconds since the epoch): when the driver calls
    its `fit()`, where rank 0 measures the `workers` start-up phase from."""
    from ray.train import CheckpointConfig

    from worker.training.loop import train_loop_per_worker

    return torch_trainer(
        spec,
        train_loop_per_worker,
        {"spec": spec.model_dump(mode="json"), "fit_started_at": fit_started_at},
        max_failures=spec.fault_tolerance.max_failures,
        checkpoint_config=checkpoint_config(spec, CheckpointConfig),
        callbacks=[CheckpointRecorder(spec), TrainingErrorStop()],
    )


def torch_trainer(
    spec: RunSpec,
    loop: Any,
    loop_config: dict[str, Any],
    *,
    max_failures: int,
    checkpoint_config: Any = None,
    callbacks: list[UserCallback] | None = None,
) -> Any:
    """A `TorchTrainer` of `loop` on the run's workers (a run's, or a profile's)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from contract.placement import worker_demand

    res = spec.resources
    return lean_trainer()(
        loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if res.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=res.num_workers,
            use_gpu=res.use_gpu,
            # The bundle the placement check measured against the nodes.
            resources_per_worker=worker_demand(res),
        ),
        run_config=RunConfig(
            name=spec.run_id,
            storage_path=spec.storage_path,
            # Ray types FailureConfig as v1's; V2's takes controller_failure_limit.
            failure_config=FailureConfig(  # type: ignore[call-arg]
                max_failures=max_failures,
                # Workers not placed within RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (the
                # service's placement timeout) end the run; Ray's default retries forever.
                controller_failure_limit=0,
            ),
            checkpoint_config=checkpoint_config,
            # Ray types `callbacks` with its v1 Callback class; V2 takes UserCallback.
            callbacks=callbacks or [],  # type: ignore[arg-type]
        ),
    )


def lean_trainer() -> Any:
    """Ray Train's `TorchTrainer`, less two of its default hooks that a run does not need,
    each an actor (a process whose imports alone cost ~2 CPU seconds at the run's start).

    - Its Ray Data hook, when no Ray Dataset is given: a run reads its data itself
      (worker/data/), yet Ray Train 2.60's `DatasetsCallback` starts a `DatasetManager`
      actor for every worker group whether datasets were given or not
      (ray/train/v2/_internal/callbacks/datasets.py) and sends Ray Data's context to every
      worker. Nothing else reads either (a worker asks the manager only in
      `get_dataset_shard`).
    - Its placement-group cleaner: a detached actor that asks Ray's state API every second
      whether the controller still lives, to remove the workers' placement group should
      the controller die while the script that started it goes on. Here that script is the
      job's driver (worker/__main__.py), which ends as soon as `fit()` raises, and Ray
      removes the placement groups of a job that has ended."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    class RunTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks: list[Any] = super()._create_default_callbacks()
            unneeded: tuple[type, ...] = (PlacementGroupCleanerCallback,)
            if not self.datasets:
                unneeded += (DatasetsCallback,)
            return [cb for cb in callbacks if not isinstance(cb, unneeded)]

    return RunTrainer


def checkpoint_config(spec: RunSpec, config_class: Any) -> Any:
    """Retention: the newest `keep_last` checkpoints; with a best metric, the `keep_last`
    best by it (every checkpoint is reported with that metric, NaN between evaluations so
    that Ray ranks it lowest: worker/training/eval_watch.py `ranked`).
    Ray always keeps the latest too, for resume. app/services/run_data.py mirrors this to
    mark what was pruned."""
    criterion = spec.best_criterion
    if criterion is None:
        return config_class(num_to_keep=spec.checkpointing.keep_last)
    metric, mode = criterion
    return config_class(
        num_to_keep=spec.checkpointing.keep_last,
        checkpoint_score_attribute=metric,
        checkpoint_score_order=mode,
    )


class CheckpointRecorder(UserCallback):
    """Runs in Ray Train's controller, which sees every persisted checkpoint and its path."""

    def __init__(self, spec: RunSpec) -> None:
        self.run_id = spec.run_id
        self.attempt = spec.attempt
        self.storage_path = spec.storage_path

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        if checkpoint is None:
            return
        from worker.reporting.logs import configure_worker_logging
        from worker.reporting.service_client import ServiceClient

        # The controller is a process of its own: its log lines name the run too.
        configure_worker_logging(run_id=self.run_id, attempt=self.attempt)
        rank0 = metrics[0] if metrics else {}
        client = ServiceClient.from_env(run_id=self.run_id, attempt=self.attempt)
        try:
            client.checkpoint(
                step=int(rank0.get("step", 0)),
                epoch=rank0.get("epoch"),
                # Ray's path is in its filesystem ("bucket/prefix/..." on S3): a URI for users.
                path=Storage(self.storage_path).location_of(checkpoint.path),
                kind="deepspeed",
                metrics={k: v for k, v in rank0.items() if isinstance(v, int | float)},
            )
        finally:
            client.close()


class TrainingErrorStop(UserCallback):
    """Ends the run on an error the training code raised, instead of restarting it.

    Ray Train restarts the worker group after any worker error, up to `max_failures`.
    That is right when a worker died with its node, and wrong when a rank raised on its
    own (a bad batch, an out-of-memory): it would fail the same way again, and its peers
    sit in the step's collective meanwhile. Raising here, in the controller, ends the run
    at once with a non-retryable controller error (ray/train/v2/_internal/execution/
    controller/controller.py: an exception in a loop iteration becomes ControllerError,
    which DefaultFailurePolicy does not retry) and Ray Train tears the worker group down,
    blocked peers included. A dead worker (a RayError that is not a task error) is left
    to Ray's own retries.
    """

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        from worker.reporting.failures import TrainingCodeError, raised_by_training_code

        if worker_exceptions and all(map(raised_by_training_code, worker_exceptions.values())):
            rank = min(worker_exceptions)
            raise TrainingCodeError.of(rank, worker_exceptions[rank])
