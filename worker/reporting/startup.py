"""An attempt's start, phase by phase (contract/callbacks.py `StartupPhase`): each part's
duration, posted by the driver and rank 0 as a `startup_phase` event, so that a slow start
says where its time went.

The phases follow one another without gaps, each measured on a wall clock (`time.time()`),
since they cross processes and may cross nodes:

- job: the service's submit (`SUBMITTED_AT_ENV`, the service's clock) to the driver's
  process starting (its creation time as the kernel records it);
- driver: from there to the call of Ray Train's `fit()`;
- workers: from `fit()` (handed to the ranks in the loop's config) to rank 0's process
  starting (zero where Ray started that process before, as an idle worker it reuses);
- process_group: from there to rank 0's training function (its imports, CUDA, and the
  process group Ray Train starts before calling it);
- imports, data, model, deepspeed: inside the training function, one after the other;
- first_step: to the end of the attempt's first step (a resumed attempt's checkpoint
  restore included).

Where Ray Train restarts the worker group within an attempt (`fault_tolerance.max_failures`),
the restarted group posts its phases again; the service keeps the first of each phase of an
attempt (app/api/internal.py), the attempt's own start.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from contract.callbacks import StartupPhase
from contract.job_env import SUBMITTED_AT_ENV

log = logging.getLogger("tuneyard.worker")

# Posts one phase and its duration in seconds (rank 0's and the driver's: to the service).
PostPhase = Callable[[StartupPhase, float], object]


def process_started_at() -> float:
    """When this process started, in seconds since the epoch."""
    import psutil

    return float(psutil.Process().create_time())


def submitted_at() -> float | None:
    """When the service submitted this job, as it set it in the job's environment."""
    try:
        return float(os.environ[SUBMITTED_AT_ENV])
    except (KeyError, ValueError):
        return None


class StartupClock:
    """Laps of one process's part of the start: each `lap` posts the time since the last."""

    def __init__(self, post: PostPhase | None, *, since: float) -> None:
        self._post = post
        self._since = since

    def lap(self, phase: StartupPhase, *, at: float | None = None) -> None:
        # Never before the last lap: a clock behind the service's (the job phase), or a
        # process Ray started before fit() and handed to the worker group (its workers
        # phase), makes a zero span, and the next phase starts where the last one ended,
        # so the phases add up to the start's wall time without overlapping.
        now = max(time.time() if at is None else at, self._since)
        seconds = now - self._since
        self._since = now
        log.info("start-up phase %s: %.2fs", phase.value, seconds)
        if self._post is not None:
            self._post(phase, seconds)
