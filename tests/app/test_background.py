"""app/background.py: a loop of ticks, woken early, resting after a tick when asked to."""

from __future__ import annotations

import threading
import time

from app.background import TickLoop

REST_S = 0.4


class Recorder(TickLoop):
    name = "test-loop"

    def __init__(self) -> None:
        # An interval far beyond the test: only a wake can start a tick in time.
        super().__init__(interval_s=60)
        self.started: list[float] = []
        self.ticked = threading.Semaphore(0)

    def tick(self) -> None:
        self.started.append(time.monotonic())
        self.ticked.release()

    def rest_s(self) -> float:
        return REST_S


def test_a_wake_during_the_rest_is_kept_for_the_end_of_it() -> None:
    loop = Recorder()
    loop.start()
    try:
        assert loop.ticked.acquire(timeout=10)  # the first tick, at start
        loop.wake()  # during the rest: kept, not lost, and not obeyed early
        assert loop.ticked.acquire(timeout=10)
        assert loop.started[1] - loop.started[0] >= REST_S
        # No further wake: the next tick waits for the interval.
        assert not loop.ticked.acquire(timeout=REST_S * 2)
    finally:
        loop.stop()


def test_stop_cuts_the_rest_short() -> None:
    loop = Recorder()
    loop.start()
    assert loop.ticked.acquire(timeout=10)
    began = time.monotonic()
    loop.stop()
    assert loop._thread is not None and not loop._thread.is_alive()
    assert time.monotonic() - began < REST_S
