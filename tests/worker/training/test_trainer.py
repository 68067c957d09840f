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


def test_no_ray_data_actor_and_no_placement_group_cleaner_start_with_a_run(
    tmp_path: Path,
) -> None:
    """Ray Train's Ray Data hook and its placement-group cleaner would each start an actor
    (a process) per attempt; the run gives no Ray Dataset and its driver ends with the
    controller, so both are left out and everything else stays."""
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    trainer = build_trainer(_spec(tmp_path))
    ours = [type(cb).__name__ for cb in trainer._create_default_callbacks()]
    stock = [type(cb).__name__ for cb in TorchTrainer(lambda: None)._create_default_callbacks()]

    left_out = {"DatasetsCallback", "PlacementGroupCleanerCallback"}
    assert left_out <= set(stock)  # what is left out is what Ray Train adds
    assert sorted(ours) == sorted(name for name in stock if name not in left_out)
    for kept in ("BackendSetupCallback", "AcceleratorSetupCallback", "UserCallbackHandler"):
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
