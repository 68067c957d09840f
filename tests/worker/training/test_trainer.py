"""worker/training/trainer.py: the `TorchTrainer` a run's driver builds."""

from __future__ import annotations

from pathlib import Path

from contract.run_request import RunRequest, RunSpec
from worker.training.trainer import build_trainer


def _spec(tmp_path: Path) -> RunSpec:
    request = RunRequest.model_validate({"model": "/models/m", "dataset": {"source": "/d.jsonl"}})
    return RunSpec.for_attempt(
        request.worker_fields(), run_id="run_x", attempt=1, storage_path=str(tmp_path)
    )


def test_no_ray_data_actor_is_started_for_a_run_that_reads_its_own_data(tmp_path: Path) -> None:
    """Ray Train's Ray Data hook would start a DatasetManager actor (a process) per attempt;
    the run gives no Ray Dataset, so the hook is left out and everything else stays."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    trainer = build_trainer(_spec(tmp_path))
    ours = [type(cb).__name__ for cb in trainer._create_default_callbacks()]
    stock = TorchTrainer(lambda: None)._create_default_callbacks()

    assert any(isinstance(cb, DatasetsCallback) for cb in stock)  # what is left out
    assert "DatasetsCallback" not in ours
    assert sorted(ours) == sorted(
        type(cb).__name__ for cb in stock if not isinstance(cb, DatasetsCallback)
    )
    for kept in ("BackendSetupCallback", "PlacementGroupCleanerCallback", "UserCallbackHandler"):
        assert kept in ours
    # The run's own callbacks (the checkpoint recorder, the error stop) still ride along.
    handler = next(
        cb
        for cb in trainer._create_default_callbacks()
        if type(cb).__name__ == "UserCallbackHandler"
    )
    assert {type(cb).__name__ for cb in handler._user_callbacks} == {
        "CheckpointRecorder",
        "TrainingErrorStop",
    }
