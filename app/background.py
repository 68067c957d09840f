"""A service thread that does its work in ticks: every interval, or at once when woken."""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("tuneyard")


class TickLoop:
    """Subclasses define `tick`; a tick that raises is logged and the next one runs on
    schedule, so one bad row or an unreachable peer never stops the loop."""

    name = "tuneyard-loop"

    def __init__(self, *, interval_s: float, join_timeout_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self.join_timeout_s = join_timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> Any:
        raise NotImplementedError

    def rest_s(self) -> float:
        """How long to rest after a tick before the next, woken or not (a wake meanwhile is
        kept for then)."""
        return 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("%s: tick failed; retrying", self.name)
            rest = self.rest_s()
            if rest > 0 and self._stop.wait(rest):
                break
            self._wake.wait(self.interval_s)
            self._wake.clear()
