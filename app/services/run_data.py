"""Reading what a run produced: metrics (paged) and checkpoints."""

from __future__ import annotations

import math
import re

from sqlalchemy import and_, or_, select, tuple_
from sqlalchemy.orm import Session

from app.errors import ValidationFailed, field_problem
from app.models import Checkpoint, Event, Metric, Run
from contract.bounds import INT32_MAX
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
    (worker/trainer.py `checkpoint_config`; a resumed attempt restores Ray Train's checkpoint
    manager with the checkpoints, so the order runs across attempts): it keeps the
    `keep_last` ranked highest and, always, the latest reported. Ranked by the order
    reported; with a best metric, by the metric (a non-finite value lowest, ties to the
    later), as ray/train/_internal/checkpoint_manager.py's `_get_checkpoint_score` does."""
    keep_last = definition.checkpointing.keep_last
    reported = sorted((c for c in checkpoints if c.kind == "deepspeed"), key=lambda c: c.id)
    if not reported:
        return set()
    ranked = reported
    if (criterion := definition.best_criterion) is not None:
        metric, mode = criterion
        sign = 1.0 if mode == "max" else -1.0

        def score(c: Checkpoint) -> tuple[bool, float]:
            value = c.metrics.get(metric)
            if not isinstance(value, int | float):
                # Stored "inf"/"-inf" rank as such; NaN (or none) below everything.
                value = {"inf": math.inf, "-inf": -math.inf}.get(str(value), math.nan)
            return (value == value, sign * value if value == value else 0.0)

        # sorted() is stable: ties keep the order reported, the later ranked higher.
        ranked = sorted(reported, key=score)
    latest = reported[-1].id
    return {c.id for c in ranked[: max(len(ranked) - keep_last, 0)] if c.id != latest}


def list_events(session: Session, *, run: Run, after: int | None, limit: int) -> list[Event]:
    """Oldest first; `after` is the id of the last event the client has seen."""
    query = select(Event).where(Event.run_id == run.id)
    if after is not None:
        query = query.where(Event.id > after)
    return list(session.scalars(query.order_by(Event.id).limit(limit)))
