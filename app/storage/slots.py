"""Admission slots that serve a request once: its later waits go ahead of new requests.

A create takes a slot three times (its checks, its write, its place in the queue) and a
worker's post twice (the token, the write); a status poll once. In a plain semaphore each
wait is at the back of the queue, so under load a request waits the queue's length once
per slot it takes: with 200 clients, creates and posts waited 2-3 times as long as polls
(BENCHMARKS.md, load). Here a request that has held a slot before waits only behind others
doing the same, so every request waits for admission about once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from starlette.requests import Request


class Slots:
    """`total` slots, on one event loop."""

    def __init__(self, total: int) -> None:
        self._free = total
        self._new: deque[anyio.Event] = deque()
        self._again: deque[anyio.Event] = deque()

    @asynccontextmanager
    async def slot(self, request: Request) -> AsyncIterator[None]:
        again = getattr(request.state, "admitted", False)
        await self._acquire(again)
        request.state.admitted = True
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, again: bool) -> None:
        if self._free > 0 and not self._new and not self._again:
            self._free -= 1  # no trip through the loop when one is free
            return
        handed = anyio.Event()
        waiting = self._again if again else self._new
        waiting.append(handed)
        try:
            await handed.wait()
        except BaseException:
            if handed.is_set():
                self._release()  # handed the slot as it was cancelled: pass it on
            else:
                waiting.remove(handed)
            raise

    def _release(self) -> None:
        for waiting in (self._again, self._new):
            if waiting:
                waiting.popleft().set()  # the slot passes straight to the next waiter
                return
        self._free += 1
