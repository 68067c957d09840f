"""SQLite writes on the event loop: at once when the database's lock is free, else in one
queue per process that a single task drains, back to back.

A write here touches the database alone (its route read files and the cluster first), so
it takes a few milliseconds, and running it on the loop costs less than a trip to a worker
thread under a busy loop's GIL (BENCHMARKS.md, load). Two such writes cannot interleave:
the loop runs one at a time. What can hold SQLite's lock instead is another connection: a
worker thread's session (the dispatcher, a `SessionDep` route) or another process of
`serve --workers N`. Then the write waits in the queue.

Why one task drains the queue rather than each writer trying in turn: a writer woken by
the one before it runs a whole loop iteration later, which under load is tens of
milliseconds, and the other process's writers took the lock in between. The queue drained
one writer per iteration, slower than writes came, and writes waited seconds (200 clients,
`--workers 2`). The drainer runs each queued write as soon as the one before it commits, and
sleeps only while another connection holds the lock.
"""

from __future__ import annotations

import asyncio
import contextvars
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from app.storage import db
from app.storage.slots import Slots

# While another connection holds the lock, the queue's first write tries again after this
# pause, doubling up to the last: the lock's holders keep it for milliseconds.
FIRST_PAUSE_S = 0.001
LAST_PAUSE_S = 0.005
# Writes run back to back for at most this long before the loop serves other requests.
TIME_SLICE_S = 0.1


@dataclass(slots=True)
class _Waiting:
    request: Request
    write: Callable[[Session], Any]
    # Given up as SQLite's own busy timeout would, counted from when the write queued.
    deadline: float
    # The request's context (its run id for log lines), for the write to run in.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    done: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def answer(self, result: Any = None, error: BaseException | None = None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(result)
        elif isinstance(error, Exception) and not isinstance(error, StopIteration):
            self.done.set_exception(error)
        else:  # a Future takes neither StopIteration nor a BaseException as its error
            self.done.set_exception(RuntimeError(f"the write raised {error!r}"))


class LoopWriter:
    """The process's SQLite writes that run on the event loop (module docstring). Each
    write takes an admission slot (`slots`) while it holds a connection."""

    def __init__(self, factory: sessionmaker[Session], slots: Slots) -> None:
        self._factory = factory
        self._slots = slots
        self._waiting: deque[_Waiting] = deque()
        self._drainer: asyncio.Task[None] | None = None

    async def write(self, request: Request, write: Callable[[Session], Any]) -> Any:
        """`write(session)` committed (rolled back if it raises), and its result."""
        # At once if the lock is free, even with writes waiting: they wait for the drainer's
        # next turn on the loop, and putting this one behind them only made it wait as well
        # (p99 of writes 1.7 s against 0.7 s, BENCHMARKS.md). The drainer tries each again
        # within milliseconds, so none of them waits for good.
        async with self._slots.slot(request):
            done, result = db.write_if_unlocked(self._factory, write)
        if done:
            return result
        waiting = _Waiting(
            request, write, deadline=time.monotonic() + db.SQLITE_BUSY_TIMEOUT_MS / 1000
        )
        # A waiter that went away (a client gone) leaves its write queued: it still runs, and
        # its error, if any, is taken here rather than logged as never retrieved.
        waiting.done.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._waiting.append(waiting)
        if self._drainer is None:
            # In a context of its own, not the request's that happened to start it.
            self._drainer = asyncio.get_running_loop().create_task(
                self._drain(), context=contextvars.Context()
            )
        return await asyncio.shield(waiting.done)

    async def _drain(self) -> None:
        try:
            pause = FIRST_PAUSE_S
            slice_began = time.monotonic()
            while self._waiting:
                first = self._waiting[0]
                try:
                    async with self._slots.slot(first.request):
                        done, result = first.context.run(
                            db.write_if_unlocked, self._factory, first.write
                        )
                except Exception as exc:  # the write's own error: its waiter's answer
                    first.answer(error=exc)
                    self._waiting.popleft()
                    continue
                if done:
                    first.answer(result)
                    self._waiting.popleft()
                    pause = FIRST_PAUSE_S  # the next at once: the lock is free now
                    if time.monotonic() - slice_began > TIME_SLICE_S:
                        await anyio.sleep(0)
                        slice_began = time.monotonic()
                    continue
                if time.monotonic() >= first.deadline:
                    first.answer(error=sqlite3.OperationalError("database is locked"))
                    self._waiting.popleft()
                    continue
                await anyio.sleep(pause)
                pause = min(2 * pause, LAST_PAUSE_S)
                slice_began = time.monotonic()
        finally:
            self._drainer = None
            # Cancelled (the app shutting down): nobody is left to run what still waits.
            while self._waiting:
                self._waiting.popleft().answer(
                    error=sqlite3.OperationalError("the service is shutting down")
                )
