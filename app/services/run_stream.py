"""Server-Sent Events for one run: its events and metrics as they arrive.

Each SSE id is "<last event id>:<last metric id>", so a client that reconnects with
Last-Event-ID continues exactly where it stopped and loses nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from sqlalchemy import select
from sqlalchemy.orm import Session
from sse_starlette import ServerSentEvent

from app.errors import ValidationFailed, field_problem
from app.schemas.run_view import EventView, MetricView
from app.services.run_data import bounded_int
from app.storage.models import Event, Metric, Run
from contract.bounds import INT64_MAX
from contract.statuses import RunStatus

POLL_INTERVAL_S = 0.5
BATCH = 500


@dataclass(slots=True)
class StreamCursor:
    event_id: int = 0
    metric_id: int = 0

    @classmethod
    def parse(cls, value: str | None) -> StreamCursor:
        if not value:
            return cls()
        parts = value.split(":")
        if len(parts) == 2:
            # Row ids: BIGINT on PostgreSQL, so a larger number is no id this stream sent.
            event_id, metric_id = (bounded_int(part, INT64_MAX) for part in parts)
            if event_id is not None and metric_id is not None:
                return cls(event_id, metric_id)
        raise ValidationFailed([field_problem("Last-Event-ID", "not an id this stream sent")])

    def __str__(self) -> str:
        return f"{self.event_id}:{self.metric_id}"


# How the stream reads: a read session under the request's admission (app/api/deps.py
# `run_in_read_session`), awaited once per poll.
Batch = tuple[list[Event], list[Metric], bool]
Reader = Callable[[Callable[[Session], Batch]], Awaitable[Batch]]


def _read(session: Session, run_id: str, cursor: StreamCursor) -> Batch:
    # Status first: on PostgreSQL each query sees the latest commit, so reading it last
    # could see a run that finished after the events query, and end without its event.
    run = session.get(Run, run_id)
    terminal = run is None or RunStatus(run.status).is_terminal()
    events = list(
        session.scalars(
            select(Event)
            .where(Event.run_id == run_id, Event.id > cursor.event_id)
            .order_by(Event.id)
            .limit(BATCH)
        )
    )
    metrics = list(
        session.scalars(
            select(Metric)
            .where(Metric.run_id == run_id, Metric.id > cursor.metric_id)
            .order_by(Metric.id)
            .limit(BATCH)
        )
    )
    return events, metrics, terminal


async def stream_run(
    read: Reader, run_id: str, cursor: StreamCursor
) -> AsyncIterator[ServerSentEvent]:
    """Until the run is terminal and everything stored has been sent."""
    while True:
        events, metrics, terminal = await read(lambda session: _read(session, run_id, cursor))
        for e in events:
            cursor.event_id = e.id
            yield ServerSentEvent(EventView.of(e).model_dump_json(), event="event", id=str(cursor))
        for m in metrics:
            cursor.metric_id = m.id
            yield ServerSentEvent(
                MetricView.of(m).model_dump_json(), event="metric", id=str(cursor)
            )
        if terminal and not events and not metrics:
            yield ServerSentEvent(json.dumps({"run_id": run_id}), event="end", id=str(cursor))
            return
        if len(events) < BATCH and len(metrics) < BATCH:
            await anyio.sleep(POLL_INTERVAL_S)
