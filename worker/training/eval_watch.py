"""What a run's evaluations decide: which checkpoint is the best so far and whether to stop.

Every rank keeps the same watch: evaluation metrics are all-reduced (worker/training/evaluation.py),
so each rank sees the same numbers and takes the same decision — a stop that only rank 0
took would leave its peers waiting in the next step's collective. Its state travels in the
DeepSpeed checkpoint's client state, so a resumed attempt keeps its patience count and its
best (a restart must neither forget an improvement nor grant fresh patience).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from contract.eval_metrics import Mode, at_least_as_good, improves
from contract.run_request import RunSpec


@dataclass(slots=True)
class WatchState:
    best_value: float | None = None  # the best checkpoint's value of the metric
    best_step: int | None = None  # and its step
    # Early stopping's metric: its best so far, and evaluations in a row that did not beat
    # that by more than min_delta.
    stop_best: float | None = None
    bad_evals: int = 0
    stopped: str | None = None  # why it stopped early (kept: a resume must not go on)


class EvalWatch:
    def __init__(self, spec: RunSpec) -> None:
        criterion = spec.best_criterion
        self.metric: str | None = criterion[0] if criterion else None
        self.mode: Mode = criterion[1] if criterion else "min"
        self.stopping = spec.early_stopping
        self.state = WatchState()
        # The step of the latest evaluation and its value of the metric (not kept across
        # a resume: the checkpoint of that step was reported before it).
        self._evaluated: tuple[int, float] | None = None

    @property
    def active(self) -> bool:
        """Whether evaluations rank checkpoints (each evaluation then saves one)."""
        return self.metric is not None

    def observe(self, metrics: dict[str, float], *, step: int) -> str | None:
        """Take an evaluation at `step`; a sentence saying why the run stops, or None."""
        if self.metric is None:
            return None
        s = self.state
        self._evaluated = step, metrics[self.metric]
        if at_least_as_good(metrics[self.metric], s.best_value, mode=self.mode):
            s.best_value, s.best_step = metrics[self.metric], step
        es = self.stopping
        if es is None:
            return None
        # Hugging Face's EarlyStoppingCallback with Trainer's best metric: the count restarts on
        # an improvement by more than min_delta over the best so far, and the best follows
        # any strict improvement (tests/worker/training/test_eval_watch.py runs a Trainer to
        # compare).
        value, mode = metrics[es.metric], es.resolved_mode
        if improves(value, s.stop_best, mode=mode, min_delta=es.min_delta):
            s.bad_evals = 0
        else:
            s.bad_evals += 1
        if improves(value, s.stop_best, mode=mode):
            s.stop_best = value
        if s.bad_evals < es.patience:
            return None
        s.stopped = (
            f"early stopping at step {step}: {es.metric} did not improve by more than "
            f"{es.min_delta:g} ({mode}) in {es.patience} evaluation(s) in a row; its best was "
            f"{s.stop_best:.6g}"
        )
        return s.stopped

    def ranked(self, metrics: dict[str, Any], *, step: int) -> dict[str, Any]:
        """`metrics` as a checkpoint at `step` reports them to Ray Train, whose retention
        ranks by this watch's metric (worker/training/trainer.py `checkpoint_config`): with the
        value evaluated at `step`, or NaN where no evaluation ran at it (a preemption's or a
        periodic checkpoint), never without it and never with an earlier evaluation's.

        Ray scores a missing metric as -inf times the order, which under `min` outranks
        every real checkpoint, and a NaN below everything (ray/train/_internal/
        checkpoint_manager.py `_get_checkpoint_score`): so a checkpoint between evaluations
        is the first pruned and never displaces the best, which `export.from: best` loads.
        An earlier evaluation's value would tie the best and, being later, displace it."""
        if self.metric is None:
            return metrics
        evaluated = self._evaluated
        value = evaluated[1] if evaluated is not None and evaluated[0] == step else math.nan
        return {**metrics, self.metric: value}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.state = WatchState(**state)
