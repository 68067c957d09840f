"""The one path by which a run is created, for both create routes (`POST /v1/runs` and
OpenAI's `POST /v1/fine_tuning/jobs`): they differ in the request they read and the view
they answer with, not in how a run comes to be."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from app.api.deps import run_in_read_session, run_in_write_session
from app.services import runs
from app.services.dispatch import Dispatcher
from app.storage.models import Run

log = logging.getLogger("tuneyard")


@dataclass(frozen=True, slots=True)
class Created:
    run: Run
    created: bool  # False: an earlier run with the same Idempotency-Key answers
    queue_position: int | None


async def create_run(
    request: Request,
    *,
    prepare: Callable[[Session], runs.NewRun],
    store: Callable[[Session, runs.NewRun], tuple[Run, bool]],
    dispatcher: Dispatcher | None,
) -> Created:
    """`prepare` runs the checks that read files and the cluster, on a read session; then
    `store` inserts the run alone, in a write transaction (see `runs.prepare_run`). Its place
    in the queue is read on a read of its own, which ranks the whole queue (no writer waits
    for that), before the dispatcher is woken, which may take it out. The run is stored
    whatever happens to that read: an answer without its place, never a 500 that would have
    a client without an Idempotency-Key create it again."""
    new = await run_in_read_session(request, prepare, blocking=True)
    run, created = await run_in_write_session(request, lambda session: store(session, new))
    try:
        position = await run_in_read_session(
            request, lambda session: runs.queue_position(session, run)
        )
    except SQLAlchemyError:
        log.warning("run %s created; its queue position could not be read", run.id, exc_info=True)
        position = None
    if dispatcher is not None and created:
        dispatcher.wake()  # committed: dispatch now, not at the dispatcher's next tick
    return Created(run, created, position)
