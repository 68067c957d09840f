"""Builds the Ray Train `TorchTrainer` for a run, and reports its checkpoints to the service."""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from contract.run_request import RunSpec


def build_trainer(spec: RunSpec) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from worker.train_loop import train_loop_per_worker

    res = spec.resources
    per_worker: dict[str, float] = {"CPU": res.cpus_per_worker}
    if res.use_gpu:
        per_worker["GPU"] = res.gpus_per_worker or 1
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec.model_dump(mode="json")},
        torch_config=TorchConfig(backend="nccl" if res.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=res.num_workers, use_gpu=res.use_gpu, resources_per_worker=per_worker
        ),
        run_config=RunConfig(
            name=spec.run_id,
            storage_path=spec.storage_path,
            failure_config=FailureConfig(max_failures=spec.fault_tolerance.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpointing.keep_last),
            # Ray types `callbacks` with its v1 Callback class; V2 takes UserCallback.
            callbacks=[CheckpointRecorder(spec.run_id, spec.attempt)],  # type: ignore[list-item]
        ),
    )


class CheckpointRecorder(UserCallback):
    """Runs in Ray Train's controller, which sees every persisted checkpoint and its path."""

    def __init__(self, run_id: str, attempt: int) -> None:
        self.run_id = run_id
        self.attempt = attempt

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        if checkpoint is None:
            return
        from worker.logs import configure_worker_logging
        from worker.service_client import ServiceClient

        # The controller is a process of its own: its log lines name the run too.
        configure_worker_logging(run_id=self.run_id, attempt=self.attempt)
        rank0 = metrics[0] if metrics else {}
        client = ServiceClient.from_env(run_id=self.run_id, attempt=self.attempt)
        try:
            client.checkpoint(
                step=int(rank0.get("step", 0)),
                epoch=rank0.get("epoch"),
                path=checkpoint.path,
                kind="deepspeed",
                metrics={k: v for k, v in rank0.items() if isinstance(v, int | float)},
            )
        finally:
            client.close()
