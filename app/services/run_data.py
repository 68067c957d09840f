"""Reading what a run produced: metrics (paged) and checkpoints."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from sqlalchemy import and_, or_, select, tuple_
from sqlalchemy.orm import Session

from app.errors import ValidationFailed, field_problem
from app.storage.models import Checkpoint, Event, Metric, Run
from contract.bounds import INT32_MAX
from contract.eval_metrics import Mode
from contract.run_request import RunDefinition

MAX_METRICS_PAGE = 10_000


def list_metrics(
    session: Session,
    *,
    run: Run,
    name: str | None,
    after_step: int | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Metric], str | None]:
    """Ordered by (step, attempt, name); the cursor is that key of the last row returned."""
    query = select(Metric).where(Metric.run_id == run.id)
    if name:
        query = query.where(Metric.name == name)
    if after_step is not None:
        query = query.where(Metric.step > after_step)
    if cursor:
        step, attempt, metric_name = _decode(cursor)
        query = query.where(
            or_(
                Metric.step > step,
                and_(Metric.step == step, Metric.attempt > attempt),
                and_(Metric.step == step, Metric.attempt == attempt, Metric.name > metric_name),
            )
        )
    limit = max(1, min(limit, MAX_METRICS_PAGE))
    order = tuple_(Metric.step, Metric.attempt, Metric.name)
    rows = list(session.scalars(query.order_by(*order.clauses).limit(limit + 1)))
    if len(rows) > limit:
        last = rows[limit - 1]
        return rows[:limit], f"{last.step}:{last.attempt}:{last.name}"
    return rows, None


def _decode(cursor: str) -> tuple[int, int, str]:
    parts = cursor.split(":", 2)
    if len(parts) == 3:
        step, attempt = bounded_int(parts[0], INT32_MAX), bounded_int(parts[1], INT32_MAX)
        name = parts[2]
        # Only what a metric row can hold: a name PostgreSQL would refuse is no cursor.
        if step is not None and attempt is not None and len(name) <= 64 and "\x00" not in name:
            return step, attempt, name
    raise ValidationFailed([field_problem("cursor", "cursor is not one this service issued")])


_DIGITS = re.compile(r"[0-9]{1,19}")


def bounded_int(text: str, maximum: int) -> int | None:
    """`text` as a number from 0 to `maximum`, or None. Stricter than `int()`, which takes
    signs, spaces, underscores and any script's digits, and any size: a number past what
    the column holds would fail in the database instead of as the client's mistake."""
    if not _DIGITS.fullmatch(text):
        return None
    value = int(text)
    return value if value <= maximum else None


def list_checkpoints(session: Session, *, run: Run) -> list[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.run_id == run.id)
    return list(session.scalars(query.order_by(Checkpoint.step, Checkpoint.id)))


def pruned_checkpoints(checkpoints: list[Checkpoint], *, definition: RunDefinition) -> set[int]:
    """The ids of the DeepSpeed checkpoints Ray Train has deleted from storage, by its rule
    (worker/training/trainer.py `checkpoint_config`; a resumed attempt restores Ray Train's
    checkpoint manager with the checkpoints, so the order runs across attempts): it keeps the
    `keep_last` ranked highest and, always, the latest reported. Ranked by the order reported, or by
    the best metric as ray/train/_internal/checkpoint_manager.py's `_get_checkpoint_score` scores
    it, ties to the later."""
    keep_last = definition.checkpointing.keep_last
    reported = sorted((c for c in checkpoints if c.kind == "deepspeed"), key=lambda c: c.id)
    if not reported:
        return set()
    ranked = reported
    if (criterion := definition.best_criterion) is not None:
        metric, mode = criterion
        # sorted() is stable: ties keep the order reported, the later ranked higher.
        ranked = sorted(reported, key=lambda c: ray_checkpoint_score(c.metrics, metric, mode))
    latest = reported[-1].id
    return {c.id for c in ranked[: max(len(ranked) - keep_last, 0)] if c.id != latest}


def ray_checkpoint_score(
    metrics: Mapping[str, object], metric: str, mode: Mode
) -> tuple[bool, float]:
    """Ray Train's score of a checkpoint reported with `metrics` (as stored: a non-finite
    value by its kind's name), higher ranked higher: the value times the order, with NaN
    below everything. A checkpoint without the metric is scored as a value of -inf, which
    for `min` is the best of all: a worker from before every checkpoint carried the metric
    (worker/training/eval_watch.py `ranked`) reported a preemption's checkpoint so, and Ray kept it
    over the best one."""
    value = metrics.get(metric, -math.inf)
    if not isinstance(value, int | float):
        value = {"inf": math.inf, "-inf": -math.inf}.get(str(value), math.nan)
    score = (1.0 if mode == "max" else -1.0) * value
    return (False, -math.inf) if math.isnan(score) else (True, score)


def list_events(session: Session, *, run: Run, after: int | None, limit: int) -> list[Event]:
    """Oldest first; `after` is the id of the last event the client has seen."""
    query = select(Event).where(Event.run_id == run.id)
    if after is not None:
        query = query.where(Event.id > after)
    return list(session.scalars(query.order_by(Event.id).limit(limit)))
