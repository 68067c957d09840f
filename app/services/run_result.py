"""A run's result: why it stopped and which checkpoint is its best (`runs.result`).

Kept up to date as the worker reports, so reading a run costs no scan of its checkpoints:
each ranked DeepSpeed checkpoint may take the best place (by the rule Ray Train's
retention uses, contract/eval_metrics.py, so the one marked best is one it kept), an
`early_stopped` event sets the stop reason, and success without one says the run
completed its steps.
"""

from __future__ import annotations

from typing import Any

from app.storage.models import Checkpoint, Run
from contract.eval_metrics import at_least_as_good
from contract.run_request import RunDefinition

EARLY_STOPPING = "early_stopping"
COMPLETED = "completed"


def _update(run: Run, **fields: Any) -> None:
    # A new dict: SQLAlchemy's JSON column sees assignment, not mutation in place.
    run.result = {**(run.result or {}), **fields}


def record_checkpoint(run: Run, checkpoint: Checkpoint) -> None:
    """A DeepSpeed checkpoint scored by the run's best metric may become its best."""
    if checkpoint.kind != "deepspeed":
        return
    criterion = RunDefinition.of_resolved(run.spec).best_criterion
    if criterion is None:
        return
    metric, mode = criterion
    value = checkpoint.metrics.get(metric)
    # A non-finite value is stored as a string ("nan", "inf"): never the best.
    if not isinstance(value, int | float):
        return
    best = (run.result or {}).get("best_value")
    if at_least_as_good(float(value), best, mode=mode):
        _update(
            run,
            best_metric=metric,
            best_mode=mode,
            best_step=checkpoint.step,
            best_value=float(value),
            best_checkpoint_id=checkpoint.id,
        )


def record_early_stop(run: Run, message: str) -> None:
    _update(run, stop_reason=EARLY_STOPPING, stop_message=message)


def record_success(run: Run) -> None:
    if (run.result or {}).get("stop_reason") is None:
        _update(run, stop_reason=COMPLETED)
