"""Which evaluation metrics a run produces, and which way each one improves.

The worker's evaluation (worker/training/evaluation.py) writes these names; the service checks a
request's `early_stopping.metric` and `checkpointing.best_metric` against them, so a typo
is a 422 before any compute instead of a run that never stops.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["min", "max"]

# Method dpo's pair metrics, as TRL's DPOTrainer names them (worker/training/dpo.py computes them).
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def eval_metric_names(*, task: str, method: str) -> tuple[str, ...]:
    """The metrics an evaluation of such a run reports, each prefixed `eval_`."""
    if method == "dpo":
        return ("eval_loss", *(f"eval_{name}" for name in PAIR_METRICS))
    if method == "grpo":
        # The grader's mean reward on the evaluation prompts, one greedy completion each.
        return ("eval_reward",)
    if task == "sequence_classification":
        return ("eval_loss", "eval_accuracy", "eval_f1")
    return ("eval_loss", "eval_perplexity")


def default_mode(metric: str) -> Mode:
    """Lower is better for losses and perplexity; higher for everything else (accuracy,
    F1, rewards, margins, log-probabilities)."""
    return "min" if metric.endswith(("loss", "perplexity")) else "max"


def improves(value: float, best: float | None, *, mode: Mode, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` (as Hugging Face's
    EarlyStoppingCallback counts an improvement). A NaN never improves; anything does
    against no best yet."""
    if value != value:  # NaN
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def at_least_as_good(value: float, best: float | None, *, mode: Mode) -> bool:
    """Whether a checkpoint scoring `value` takes the best place from one scoring `best`.
    Ties go to the later checkpoint, as Ray Train's checkpoint manager ranks them (its
    retention keeps the best, and tuneyard's `best` flag must name one it kept)."""
    if value != value:
        return False
    if best is None or best != best:
        return True
    return value <= best if mode == "min" else value >= best
