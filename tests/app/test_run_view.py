"""A run as clients read it: progress, and when a running run will be done."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from app.schemas.run_view import RunView


def _run(**fields: Any) -> Any:
    """The columns RunView.of reads (app.schemas.run_view.RunFields), as a row has them."""
    now = datetime.now(UTC)
    row: dict[str, Any] = {
        "id": "run_1",
        "status": "running",
        "attempt": 1,
        "ray_submission_id": "run_1-1",
        "created_at": now,
        "queued_at": now,
        "started_at": now,
        "finished_at": None,
        "spec": {"model": "m"},
        "run_metadata": {},
        "step": 20,
        "total_steps": 100,
        "epoch": 0.2,
        "latest_metrics": {"step_time_seconds": 1.5, "loss": 2.0},
        "error_code": None,
        "error_message": None,
        "model_path": None,
        "latest_checkpoint": None,
        "result": None,
        "priority": 50,
        "preemptible": True,
        "queue_reason": None,
    }
    return SimpleNamespace(**{**row, **fields})


class TestProgress:
    def test_a_running_run_finishes_its_remaining_steps_at_the_measured_step_time(
        self,
    ) -> None:
        before = datetime.now(UTC)
        progress = RunView.of(_run()).progress
        after = datetime.now(UTC)
        # 80 steps left at the latest measured 1.5 s a step.
        assert progress.eta_seconds == 80 * 1.5
        assert progress.estimated_finish is not None
        assert before + timedelta(seconds=120) <= progress.estimated_finish
        assert progress.estimated_finish <= after + timedelta(seconds=120)

    @pytest.mark.parametrize(
        "fields",
        [
            {"status": "queued", "step": 0, "latest_metrics": {}},
            {"status": "succeeded", "step": 100},
            {"status": "cancelling"},
            {"latest_metrics": {"loss": 2.0}},  # no step measured yet
            {"total_steps": None},  # the run's length is not known
        ],
    )
    def test_no_finish_without_a_running_run_a_measured_step_and_a_length(
        self, fields: dict[str, Any]
    ) -> None:
        progress = RunView.of(_run(**fields)).progress
        assert progress.eta_seconds is None
        assert progress.estimated_finish is None

    def test_served_as_an_iso_time_in_utc(self) -> None:
        served = RunView.of(_run()).model_dump(mode="json")["progress"]["estimated_finish"]
        assert datetime.fromisoformat(served).utcoffset() == timedelta(0)
